/* The one CUDA runtime type nvimgcodec.h needs, so the shim builds without the CUDA toolkit's
   headers (the stream is only passed through as an opaque pointer). */
#ifndef HEADRACE_CUDA_RUNTIME_API_STUB_H
#define HEADRACE_CUDA_RUNTIME_API_STUB_H
typedef struct CUstream_st* cudaStream_t;
#endif
