// Compiles one body of per-ISA code three times: include this file with SRT_ISA_BODY defined as
// the body's header name. The body is written against SRT_ISA_NS (its namespace), SRT_ISA_VEC
// (a vec.h struct) and SRT_ISA_TARGET (the function attribute of that instruction set), and lands
// in srt_cpu::scalar, srt_cpu::avx2 and srt_cpu::avx512 (the last two on x86-64 only); callers
// pick one at run time with detect_isa(). No include guard: once per body.
#include "vec.h"

#define SRT_ISA_NS scalar
#define SRT_ISA_VEC VecScalar
#define SRT_ISA_TARGET
#include SRT_ISA_BODY
#undef SRT_ISA_NS
#undef SRT_ISA_VEC
#undef SRT_ISA_TARGET

#if SRT_CPU_X86
#define SRT_ISA_NS avx2
#define SRT_ISA_VEC VecAvx2
#define SRT_ISA_TARGET SRT_TARGET_AVX2
#include SRT_ISA_BODY
#undef SRT_ISA_NS
#undef SRT_ISA_VEC
#undef SRT_ISA_TARGET

#define SRT_ISA_NS avx512
#define SRT_ISA_VEC VecAvx512
#define SRT_ISA_TARGET SRT_TARGET_AVX512
#include SRT_ISA_BODY
#undef SRT_ISA_NS
#undef SRT_ISA_VEC
#undef SRT_ISA_TARGET
#endif
