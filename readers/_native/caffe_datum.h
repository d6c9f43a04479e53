/* An encoded caffe.Datum's image and label found in its protocol-buffer bytes, without protobuf.
 *
 * Why: protobuf's parser copies the image out of the value into a fresh bytes object, and the
 * value had been copied out of the LMDB map before it: both fresh memory, whose page faults were
 * most of a value's cost (readers/caffe.py). Knowing where the image lies in the map, the reader
 * copies it once, into a blob of its sample pool (sample_pool.c), with the GIL let go.
 *
 * Only the plain form is taken: each field of the Datum at most once and of its own wire type,
 * `data` not empty, `encoded` 1, no `float_data` and no field a Datum has not. Anything else
 * answers "not plain", and the reader parses that value with protobuf, which then decides (its
 * value, or its error: a raw Datum, another message).
 *
 * The schema (caffe.proto, proto2): Datum { optional int32 channels = 1; optional int32 height = 2;
 * optional int32 width = 3; optional bytes data = 4; optional int32 label = 5;
 * repeated float float_data = 6; optional bool encoded = 7; }
 */
#include <stdint.h>

#include "protobuf_wire.h"

typedef struct {
    int64_t data_offset, data_length; /* the image's span in the value */
    int has_label;
    int32_t label;
} HrDatum;

/* The Datum in `value[0:size]` into `out`: 1 where it is plain, 0 where protobuf must parse it. */
static int hr_datum_scan(const uint8_t* value, int64_t size, HrDatum* out)
{
    HrCursor c = {value, value + size};
    int seen[8] = {0};
    uint64_t encoded = 0;
    out->has_label = 0;
    out->data_length = 0;
    while (c.p < c.end) {
        uint32_t field;
        int wire;
        if (!hr_tag(&c, &field, &wire) || field > 7 || seen[field]++ || field == 6)
            return 0; /* a field a Datum has not, one twice (protobuf keeps the last), or float_data */
        if (field == 4) {
            HrCursor data;
            if (wire != 2 || !hr_len(&c, &data))
                return 0;
            out->data_offset = data.p - value;
            out->data_length = data.end - data.p;
            continue;
        }
        uint64_t v;
        if (wire != 0 || !hr_varint(&c, &v))
            return 0;
        if (field == 5) { /* an int32: the varint's low 32 bits (a negative one is spelt in 64) */
            out->has_label = 1;
            out->label = (int32_t)(uint32_t)(v & 0xFFFFFFFFu);
        } else if (field == 7) {
            encoded = v;
        }
    }
    return out->data_length > 0 && encoded == 1;
}
