/* Host CPU per image of libjpeg-turbo on a list of JPEGs, one thread: the whole image to RGB, the
 * training pipeline's random-resized-crop window (jpeg_crop_scanline + jpeg_skip_scanlines, stopped
 * after the window's last row), and the entropy stage alone (jpeg_read_coefficients), with the
 * accurate (islow) and fast (ifast) inverse DCTs. The question it answered (issue 22,
 * docs/benchmarks.md, twenty-eighth session): would the CUDA decoder's share of a batch cost fewer
 * host cores decoded by libjpeg-turbo on the host than through nvJPEG's hybrid backend (Huffman on
 * the host, the rest on the GPU)? On an H200 host it would not.
 *
 *   gcc -O2 -o libjpeg_host_cost examples/libjpeg_host_cost.c -ljpeg -lm   # libjpeg-turbo's headers
 *   find DATA -name '*.jpg' > list.txt && ./libjpeg_host_cost list.txt
 */
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <jpeglib.h>

enum { WHOLE, WINDOW, COEFFICIENTS };
enum { MAX_FILES = 20000 };

struct error_exit { struct jpeg_error_mgr pub; jmp_buf jump; };

static void on_error(j_common_ptr info) { longjmp(((struct error_exit *)info->err)->jump, 1); }

static double thread_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The same windows every pass: a small LCG, reset before each. */
static unsigned seed;
static double uniform(void) { seed = seed * 1103515245u + 12345u; return (seed >> 8) / 16777216.0; }

static unsigned char *rows;
static size_t rows_capacity;

static int decode(const unsigned char *data, size_t size, int what, int fast) {
  struct jpeg_decompress_struct d;
  struct error_exit err;
  d.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&d);
    return -1;
  }
  jpeg_create_decompress(&d);
  jpeg_mem_src(&d, data, size);
  jpeg_read_header(&d, TRUE);
  if (what == COEFFICIENTS) {
    jpeg_read_coefficients(&d);
    jpeg_finish_decompress(&d);
    jpeg_destroy_decompress(&d);
    return 0;
  }
  d.out_color_space = JCS_RGB;
  if (fast) d.dct_method = JDCT_IFAST;
  jpeg_start_decompress(&d);
  unsigned width = d.output_width, height = d.output_height, y0 = 0, end = height;
  if (what == WINDOW) { /* RandomResizedCrop's draw: area 8-100%, aspect 3/4-4/3, ten tries */
    JDIMENSION x0 = 0, w = width;
    for (int attempt = 0; attempt < 10; attempt++) {
      double area = (0.08 + 0.92 * uniform()) * width * height, ratio = 0.75 + uniform() * (4.0 / 3 - 0.75);
      unsigned cw = (unsigned)(0.5 + sqrt(area * ratio)), ch = (unsigned)(0.5 + sqrt(area / ratio));
      if (cw && ch && cw <= width && ch <= height) {
        w = cw;
        x0 = (JDIMENSION)(uniform() * (width - cw + 1));
        y0 = (unsigned)(uniform() * (height - ch + 1));
        end = y0 + ch;
        break;
      }
    }
    jpeg_crop_scanline(&d, &x0, &w);
    if (y0) jpeg_skip_scanlines(&d, y0);
  }
  size_t needed = (size_t)d.output_width * 3 * height;
  if (needed > rows_capacity) {
    rows = realloc(rows, needed);
    rows_capacity = needed;
  }
  while (d.output_scanline < end) {
    JSAMPROW row = rows + (size_t)d.output_scanline * d.output_width * 3;
    jpeg_read_scanlines(&d, &row, 1);
  }
  if (d.output_scanline < height) jpeg_abort_decompress(&d); /* the rows below the window: not decoded */
  else jpeg_finish_decompress(&d);
  jpeg_destroy_decompress(&d);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIST (one JPEG path a line)\n", argv[0]);
    return 2;
  }
  FILE *list = fopen(argv[1], "r");
  if (!list) { perror(argv[1]); return 2; }
  static unsigned char *blobs[MAX_FILES];
  static size_t sizes[MAX_FILES];
  char path[4096];
  int count = 0;
  size_t total = 0;
  while (count < MAX_FILES && fscanf(list, "%4095s", path) == 1) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 2; }
    fseek(f, 0, SEEK_END);
    sizes[count] = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    blobs[count] = malloc(sizes[count]);
    if (fread(blobs[count], 1, sizes[count], f) != sizes[count]) { perror(path); return 2; }
    fclose(f);
    total += sizes[count++];
  }
  fclose(list);
  static const char *names[] = {"whole", "window", "coefficients"};
  for (int fast = 0; fast < 2; fast++) {
    for (int what = WHOLE; what <= COEFFICIENTS; what++) {
      if (fast && what == COEFFICIENTS) continue; /* no inverse DCT there */
      for (int pass = 0; pass < 2; pass++) { /* the first warms the caches */
        seed = 12345;
        int failed = 0;
        double t = thread_seconds();
        for (int i = 0; i < count; i++) failed += decode(blobs[i], sizes[i], what, fast) != 0;
        t = thread_seconds() - t;
        if (pass)
          printf("%-13s %s: %6.0f images/s per core (%.3f ms), %.0f MB/s, %d failed\n", names[what],
                 fast ? "ifast" : "islow", count / t, 1e3 * t / count, total / t / 1e6, failed);
      }
    }
  }
  return 0;
}
