// The online-softmax pieces the attention kernels' per-ISA bodies share (decode_attention_kernel.h,
// extend_attention_kernel.h). No include guard: a body includes it inside its ISA namespace, where
// Vec, reg, W and SRT_ISA_TARGET are defined (isa_instances.h), once per body and ISA.

// acc [D] *= alpha
SRT_ISA_TARGET inline void scale_row(float* acc, float alpha, int64_t D) {
  const reg a = Vec::set1(alpha);
  int64_t d = 0;
  for (; d + W <= D; d += W) Vec::store(acc + d, Vec::mul(Vec::load(acc + d), a));
  for (; d < D; ++d) acc[d] *= alpha;
}

// s [n] (n a multiple of W) = cap * tanh(s / cap), as cap * (1 - 2 / (e^(2 s / cap) + 1)): exp
// saturates at both ends, so large |s| gives exactly +-cap.
SRT_ISA_TARGET inline void cap_scores(float* s, int64_t n, float cap) {
  const reg c = Vec::set1(cap), two_over_c = Vec::set1(2.f / cap), one = Vec::set1(1.f), two = Vec::set1(2.f);
  for (int64_t j = 0; j < n; j += W) {
    const reg e = Vec::exp(Vec::mul(Vec::load(s + j), two_over_c));
    Vec::store(s + j, Vec::mul(c, Vec::sub(one, Vec::div(two, Vec::add(e, one)))));
  }
}

// One online-softmax step of one query row over a block of n scores (n a multiple of W; -inf where
// masked): the running max m and sum l taken on, acc [D] (the weighted values so far) rescaled
// when the max grows, and s turned into the block's unnormalized probabilities.
SRT_ISA_TARGET inline void softmax_step(float* s, int64_t n, float* acc, float& m, float& l, int64_t D) {
  reg mx = Vec::load(s);
  for (int64_t j = W; j < n; j += W) mx = Vec::max(mx, Vec::load(s + j));
  const float bm = Vec::hmax(mx);
  if (bm > m) {
    if (l != 0.f) {  // l == 0: nothing accumulated yet, acc is still zero
      const float alpha = std::exp(m - bm);
      scale_row(acc, alpha, D);
      l *= alpha;
    }
    m = bm;
  }
  const reg mv = Vec::set1(m);
  reg sum = Vec::zero();
  for (int64_t j = 0; j < n; j += W) {
    const reg p = Vec::exp(Vec::sub(Vec::load(s + j), mv));
    Vec::store(s + j, p);
    sum = Vec::add(sum, p);
  }
  l += Vec::hsum(sum);
}
