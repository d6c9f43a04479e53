/* A tf.train.Example's wanted features found in its protocol-buffer bytes, without protobuf.
 *
 * Why: protobuf's parser copies each bytes value out of the record into a fresh bytes object, and
 * the reader read the record into a fresh one before it; both were page faults and malloc more
 * than copies (readers/tfrecord.py). Knowing where a feature's value lies in the record, the reader
 * copies it once, into a blob of its sample pool (sample_pool.c), with the GIL let go.
 *
 * Only the plain form is taken: each wanted feature present once, as a list of exactly one bytes
 * value or one int64. Anything else (a feature missing, a float or longer list, a field repeated
 * where protobuf would merge, a key that is not ASCII, a group, bytes that do not parse) answers
 * "not plain", and the reader parses that record with protobuf, which then decides (its value, or
 * its error). Every record is checked whole, every feature's list too, so that no record this scan
 * takes is one protobuf would refuse.
 *
 * The schema (TensorFlow's example.proto and feature.proto):
 *   Example { Features features = 1; }
 *   Features { map<string, Feature> feature = 1; }   (entries: key = 1, value = 2)
 *   Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
 *   BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
 *   Int64List { repeated int64 value = 1 [packed]; }
 */
#include <stdint.h>
#include <string.h>

#include "protobuf_wire.h"

enum { HR_FEATURE_BYTES = 1, HR_FEATURE_INT64 = 3 };

typedef struct {
    int64_t kind; /* HR_FEATURE_BYTES or HR_FEATURE_INT64 */
    int64_t a;    /* bytes: the value's offset in the record; int64: the value */
    int64_t b;    /* bytes: its length */
} HrFeature;

/* A BytesList, Int64List or FloatList (`list_kind` 1, 3, 2) checked whole: its value count, and the
 * first value (bytes: its span; int64: the value). */
static int hr_list(HrCursor c, int list_kind, int64_t* count, HrCursor* first_bytes, uint64_t* first_value)
{
    int wire, next;
    *count = 0;
    while ((next = hr_next(&c, 1, &wire)) > 0) {
        if (list_kind == HR_FEATURE_BYTES) {
            HrCursor value;
            if (wire != 2 || !hr_len(&c, &value))
                return 0;
            if ((*count)++ == 0)
                *first_bytes = value;
        } else if (list_kind == HR_FEATURE_INT64) {
            if (wire == 0) {
                uint64_t v;
                if (!hr_varint(&c, &v))
                    return 0;
                if ((*count)++ == 0)
                    *first_value = v;
            } else if (wire == 2) { /* packed */
                HrCursor packed;
                if (!hr_len(&c, &packed))
                    return 0;
                while (packed.p < packed.end) {
                    uint64_t v;
                    if (!hr_varint(&packed, &v))
                        return 0;
                    if ((*count)++ == 0)
                        *first_value = v;
                }
            } else {
                return 0;
            }
        } else { /* floats: counted, never taken */
            if (wire == 5) {
                if (!hr_skip(&c, 5))
                    return 0;
                (*count)++;
            } else if (wire == 2) {
                HrCursor packed;
                if (!hr_len(&c, &packed) || (packed.end - packed.p) % 4 != 0)
                    return 0;
                *count += (packed.end - packed.p) / 4;
            } else {
                return 0;
            }
        }
    }
    return next == 0;
}

/* A Feature checked whole; its one list's kind (0 with none) and, where that list holds exactly one
 * value, the value in *out (out->kind stays 0 otherwise). */
static int hr_feature(HrCursor c, const uint8_t* record, HrFeature* out)
{
    int kinds = 0;
    out->kind = 0;
    while (c.p < c.end) {
        uint32_t field;
        int wire;
        if (!hr_tag(&c, &field, &wire))
            return 0;
        if (field < 1 || field > 3) {
            if (!hr_skip(&c, wire))
                return 0;
            continue;
        }
        HrCursor list, first_bytes = {0, 0};
        uint64_t first_value = 0;
        int64_t count;
        if (wire != 2 || !hr_len(&c, &list) || ++kinds > 1 || !hr_list(list, (int)field, &count, &first_bytes, &first_value))
            return 0; /* a second list of the oneof: protobuf's last-wins and merging are left to it */
        if (count == 1 && field == HR_FEATURE_BYTES)
            *out = (HrFeature){HR_FEATURE_BYTES, first_bytes.p - record, first_bytes.end - first_bytes.p};
        else if (count == 1 && field == HR_FEATURE_INT64)
            *out = (HrFeature){HR_FEATURE_INT64, (int64_t)first_value, 0};
    }
    return 1;
}

/* One map entry checked whole: its key's span and its Feature, once each (a key that is not ASCII
 * is left to protobuf, which checks UTF-8, as is an entry with any other field). */
static int hr_entry(HrCursor c, const uint8_t* record, HrCursor* key, HrFeature* feature)
{
    int keys = 0, values = 0;
    key->p = key->end = c.p; /* no key: "" */
    feature->kind = 0;
    while (c.p < c.end) {
        uint32_t field;
        int wire;
        if (!hr_tag(&c, &field, &wire))
            return 0;
        if (field == 1) {
            if (wire != 2 || !hr_len(&c, key) || ++keys > 1)
                return 0;
            for (const uint8_t* q = key->p; q < key->end; q++)
                if (*q & 0x80)
                    return 0;
        } else if (field == 2) {
            HrCursor value;
            if (wire != 2 || !hr_len(&c, &value) || ++values > 1 || !hr_feature(value, record, feature))
                return 0;
        } else {
            return 0; /* protobuf keeps an entry with a field it does not know out of the map */
        }
    }
    return 1;
}

/* The `k` wanted features (`names[i]`, `name_lengths[i]` bytes) of the Example in `data[0:size]`
 * into `out`: 1 where each is there once in the plain form, 0 where protobuf must parse it. */
static int hr_example_scan(const uint8_t* data, int64_t size, int k, const char* const* names,
                           const int64_t* name_lengths, HrFeature* out)
{
    HrCursor c = {data, data + size};
    int features_seen = 0, wire, next, next_entry;
    for (int i = 0; i < k; i++)
        out[i].kind = -1; /* not found yet */
    while ((next = hr_next(&c, 1, &wire)) > 0) {
        HrCursor features;
        if (wire != 2 || !hr_len(&c, &features) || ++features_seen > 1)
            return 0; /* a second Features message merges into the first: left to protobuf */
        while ((next_entry = hr_next(&features, 1, &wire)) > 0) {
            HrCursor entry, key;
            HrFeature feature;
            if (wire != 2 || !hr_len(&features, &entry) || !hr_entry(entry, data, &key, &feature))
                return 0;
            int64_t key_length = key.end - key.p;
            for (int i = 0; i < k; i++) {
                if (name_lengths[i] != key_length || memcmp(names[i], key.p, (size_t)key_length) != 0)
                    continue;
                if (out[i].kind != -1 || feature.kind == 0)
                    return 0; /* twice (the map keeps the last), or not one bytes or int64 value */
                out[i] = feature;
            }
        }
        if (next_entry < 0)
            return 0;
    }
    if (next < 0)
        return 0;
    for (int i = 0; i < k; i++)
        if (out[i].kind == -1)
            return 0; /* missing: protobuf's path names the features the record has */
    return 1;
}
