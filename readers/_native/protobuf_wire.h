/* The protocol-buffer wire format, read as far as the readers' scans need it (tf_example.h,
 * caffe_datum.h): a cursor over bytes, varints, tags, length-delimited fields and skipping a field.
 * Each call answers 0 where the bytes do not parse; the callers then leave the value to protobuf.
 */
#ifndef HR_PROTOBUF_WIRE_H
#define HR_PROTOBUF_WIRE_H

#include <stdint.h>

typedef struct {
    const uint8_t* p;
    const uint8_t* end;
} HrCursor;

/* A varint of at most 10 bytes into *v; 0 where it runs past the end or past 64 bits. */
static int hr_varint(HrCursor* c, uint64_t* v)
{
    uint64_t value = 0;
    for (int i = 0; i < 10; i++) {
        if (c->p >= c->end)
            return 0;
        uint8_t byte = *c->p++;
        if (i == 9 && byte > 1)
            return 0;
        value |= (uint64_t)(byte & 0x7F) << (7 * i);
        if (!(byte & 0x80)) {
            *v = value;
            return 1;
        }
    }
    return 0;
}

/* The next field's number and wire type; 0 at a bad tag (number 0, past 32 bits, or spelt in more
 * than 5 bytes, which protobuf refuses). */
static int hr_tag(HrCursor* c, uint32_t* field, int* wire)
{
    uint64_t tag;
    const uint8_t* start = c->p;
    if (!hr_varint(c, &tag) || c->p - start > 5 || tag > 0xFFFFFFFFu || (tag >> 3) == 0)
        return 0;
    *field = (uint32_t)(tag >> 3);
    *wire = (int)(tag & 7);
    return 1;
}

/* A length-delimited field's bytes as a cursor of their own. */
static int hr_len(HrCursor* c, HrCursor* inner)
{
    uint64_t n;
    if (!hr_varint(c, &n) || n > (uint64_t)(c->end - c->p))
        return 0;
    inner->p = c->p;
    inner->end = c->p + n;
    c->p += n;
    return 1;
}

/* Past a field of an unknown number; 0 for a group's wire types and anything out of bounds. */
static int hr_skip(HrCursor* c, int wire)
{
    uint64_t ignored;
    HrCursor inner;
    switch (wire) {
    case 0:
        return hr_varint(c, &ignored);
    case 1:
    case 5: {
        int64_t n = wire == 1 ? 8 : 4;
        if (c->end - c->p < n)
            return 0;
        c->p += n;
        return 1;
    }
    case 2:
        return hr_len(c, &inner);
    default:
        return 0;
    }
}

/* On to the next field numbered `number`, fields of other numbers skipped: 1 with its wire type in
 * *wire, 0 at the end, -1 where the bytes do not parse. */
static int hr_next(HrCursor* c, uint32_t number, int* wire)
{
    while (c->p < c->end) {
        uint32_t field;
        if (!hr_tag(c, &field, wire))
            return -1;
        if (field == number)
            return 1;
        if (!hr_skip(c, *wire))
            return -1;
    }
    return 0;
}

#endif
