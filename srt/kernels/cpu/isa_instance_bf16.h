// A fourth copy of a per-ISA body (see isa_instances.h), for CPUs with AVX512-BF16: include this
// file with SRT_ISA_BODY defined, after isa_instances.h. The body lands in srt_cpu::avx512_bf16,
// compiled for AVX-512 with vdpbf16ps, SRT_ISA_BF16_DOT set to 1 for its bf16-only parts (x86-64
// only; callers check the CPU at run time). No include guard: once per body.
#if SRT_CPU_X86
#define SRT_ISA_NS avx512_bf16
#define SRT_ISA_VEC VecAvx512
#define SRT_ISA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#define SRT_ISA_BF16_DOT 1
#include SRT_ISA_BODY
#undef SRT_ISA_BF16_DOT
#undef SRT_ISA_NS
#undef SRT_ISA_VEC
#undef SRT_ISA_TARGET
#endif
