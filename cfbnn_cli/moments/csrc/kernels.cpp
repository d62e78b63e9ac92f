/* cfbnn's CPU kernels: activation moments and the closed-form ELBO's passes.
 *
 * Compiled when the package is installed (setup.py), beside the operators' units (family_ops.cpp,
 * piecewise_ops.cpp, elbo_ops.cpp), which call the kernels declared in kernels.h (included here too,
 * so that a definition cannot drift from its declaration) and register them with torch's dispatcher.
 *
 * This unit needs no torch headers: the kernels take raw pointers (contiguous float32/float64
 * arrays), so it compiles with the fastest flags the machine takes (-march=native, OpenMP, glibc's
 * vector math library) without the seconds that torch's headers add to a translation unit.
 *
 * Numerics are those of the operators' reference kernels (`cfbnn_cli.moments.gaussian`,
 * `cfbnn_cli.moments.relu_family`, `cfbnn_cli.moments.piecewise_polynomial`):
 * * the Normal mass on the far side of a kink from the mean is the *small tail*
 *   `S_k = E[w^k 1{w>0}]`, `w ~ N(-|d|, std^2)`, with `S_k = std^k u_k(x)`,
 *   `x = |d|/std`, `u_k = phi(x) J_k(x)` and `J_k(x) = int_0^inf v^k e^{-xv - v^2/2} dv`;
 * * float32 results (ReLU, leaky ReLU, ReLU^2, hard sigmoid): `J_0..J_4` from fitted
 *   polynomials in `t = (x-4)/(x+4)` (relative error <= 8e-7 in float32 arithmetic, no
 *   cancellation) and `phi(x)` from `expf` of a two-float `x^2/2`; all float32
 *   arithmetic (16 lanes). Beyond x = 13.14 the float32 tail is 0 unless std > 1 can make
 *   it a normal float32 -- those elements are redone in float64;
 * * float64 results (and the general engine in either precision, whose sums of pieces
 *   can subtract nearly equal tails): `u_0 = erfc(x/sqrt2)/2`, `u_1 = phi(x) - x u_0`,
 *   `u_k = (k-1) u_{k-2} - x u_{k-1}` (errata "All orders") up to the distance where this
 *   recursion still holds its digits (measured against 50-digit values), beyond it the ratios
 *   `r_j = u_j/u_{j-1}` from the continued fraction `r_j = j/(x + r_{j+1})` (Miller's
 *   backward evaluation; depths as `gaussian._CF_BANDS_F64`), vectorized over the elements
 *   of a block that need it;
 * * the backward pass uses the heat equation `dE[f]/dstd = std d^2E[f]/dmean^2`:
 *   every partial derivative is an expectation of a lower-degree piecewise polynomial plus
 *   density terms at the kinks, i.e. the same small tails.
 *
 * The main loops are branch free (the std == 0 limit and the sides of the mean are
 * arithmetic selects) so that gcc vectorizes them, calling glibc's libmvec
 * `erfc`/`exp`/`expf` when `CFBNN_MVEC` is defined; the rare elements that need
 * the continued fraction, float64 far tails or Gauss-Legendre quadrature are patched by
 * a pass over just those elements. Blocks of `NB` elements are spread over OpenMP
 * threads; the last, partial block is padded so that every element takes the same
 * instructions wherever it sits (results do not depend on the thread count).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__SSE__)
#include <xmmintrin.h>
#define CFBNN_MXCSR 1
#endif

#if defined(CFBNN_MVEC)
/* glibc's vector variants (libmvec): math.h's functions, redeclared with their SIMD clones */
__attribute__((simd("notinbranch"))) double erfc(double) noexcept;
__attribute__((simd("notinbranch"))) double exp(double) noexcept;
__attribute__((simd("notinbranch"))) float expf(float) noexcept;
#endif

#define INLINE static inline __attribute__((always_inline))
#define RS __restrict__

static const int NB = 256;                     // elements per block (L1-resident scratch)
static const int64_t PAR_MIN = 16384;          // smaller calls run on one thread
static const double T_MAX = 1e4;               // gaussian.T_MAX
static const double X_CLAMP = 37.5;            // beyond: every Gaussian factor < 1e-305, taken as 0
static const double TINY = 2.2250738585072014e-308;
static const float FTINY = 1.17549435e-38f;
static const double INV_SQRT2 = 0.70710678118654752440084436210;
static const double LOG_INV_SQRT_2PI = -0.91893853320467274178032973640;
static const double INV_SQRT_2PI = 0.39894228040143267793994605993;
static const float INV_SQRT_2PI_F = 0.398942280f;
#define MAX_K 32
#define MAX_B 64

/* Float32 kernels flush denormals (results below FLT_MIN are not held to any accuracy,
   and denormal operands cost microcode assists); restored on exit. */
struct FlushDenormals {
#ifdef CFBNN_MXCSR
  unsigned int saved;
  bool active;
  explicit FlushDenormals(bool on) : saved(_mm_getcsr()), active(on) {
    if (active) _mm_setcsr(saved | 0x8040u);
  }
  ~FlushDenormals() {
    if (active) _mm_setcsr(saved);
  }
#else
  explicit FlushDenormals(bool) {}
#endif
};

/* Standardized distance |d|/std with the std == 0 limit (gaussian.standardize):
   huge or infinite ratios end at T_MAX, 0/0 is 0. */
INLINE double distance(double ad, double s) {
  double x = ad / (s > TINY ? s : TINY);
  return x < T_MAX ? x : T_MAX;
}

/* Where the float64 forward recursion u_k = (k-1) u_{k-2} - x u_{k-1} still holds ~1e-11
   (measured against 50-digit values: it loses ~x^(2k)/k! times the error of erfc and exp),
   and the extra depth of the continued fraction by band (gaussian._CF_BANDS_F64). */
INLINE double recursion_limit(int K) { return K <= 2 ? 7.0 : (K <= 4 ? 3.0 : 2.0); }
/* The same for float32 results (tails wanted to ~1e-8): u_4 is still 2e-8 at x = 8, u_6 at 5, u_8 at 4. */
INLINE double recursion_limit_f32(int K) { return K <= 4 ? 8.0 : (K <= 6 ? 5.0 : (K <= 8 ? 4.0 : 2.0)); }
static const double BAND_EDGES[5] = {2.0, 3.0, 4.5, 8.0, 1e300};
static const int BAND_EXTRA[4] = {80, 64, 40, 24};
/* For float32 results: the depths that reach 1e-10 for orders <= 8 from each band's lower edge
   (measured against 40-digit ratios). */
static const int BAND_EXTRA_F32[4] = {46, 26, 16, 9};

/* ------------------------------------------------------------ float32 small tails */

/* u_k(x) = E[(v - x)^k 1{v > x}] = phi(x) J_k(x), v ~ N(0,1), with
   J_k(x) = int_0^inf w^k exp(-x w - w^2/2) dw = k! q_k(t) / (x + 4)^(k+1), t = (x - 4)/(x + 4):
   q_k are least-squares (Lawson) polynomial fits to 50-digit values on 0 <= x <= 13.25,
   relative error <= 3e-7 for k <= 2 and <= 8e-7 for k <= 4 when evaluated in float32
   (tests/test_moments_fast.py checks them against mpmath). No recursion, so nothing cancels. */
static const float JC0[9] = {1.893219113e+00f, -1.523771405e+00f, 9.704024196e-01f, -4.675286114e-01f, 1.514874101e-01f, -1.895222254e-02f, -9.171893820e-03f, 3.974467050e-03f, 1.041458803e-03f};
static const float JC1[10] = {3.416990042e+00f, -4.988358974e+00f, 4.313840389e+00f, -2.475792646e+00f, 8.516464829e-01f, -6.048326939e-02f, -9.053896368e-02f, 2.763648145e-02f, 9.176957421e-03f, -1.887626015e-03f};
static const float JC2[11] = {5.911170483e+00f, -1.179639244e+01f, 1.234129715e+01f, -7.892273426e+00f, 2.707112551e+00f, 5.557559803e-02f, -4.642137289e-01f, 1.005182192e-01f, 6.799248606e-02f, -2.173314244e-02f, -1.161196083e-02f};
static const float JC3[12] = {9.843301773e+00f, -2.395605469e+01f, 2.846107483e+01f, -1.939398956e+01f, 6.224526405e+00f, 1.076105356e+00f, -1.631389141e+00f, 1.552717835e-01f, 3.282543421e-01f, -4.587792233e-02f, -6.698108464e-02f, -9.998533875e-03f};
static const float JC4[13] = {1.583231544e+01f, -4.417560959e+01f, 5.723706436e+01f, -4.016375351e+01f, 1.110474300e+01f, 4.864793777e+00f, -4.356355190e+00f, -2.119750530e-01f, 1.111387730e+00f, -1.508189552e-02f, -2.486576140e-01f, -2.071559243e-02f, 2.137201279e-02f};
static const float XF = 13.14f;  // phi(x) >= FLT_MIN up to here; beyond, the float32 tail is 0
/* The clamps of the vectorized loops are read from these (interposable, so not constant-folded)
   variables: with a compile-time constant, gcc rewrites expf(min(x, C)) as a select between
   expf(x) and the folded expf(C) -- and expf of the unclamped x underflows, which sends the
   vector expf to its scalar fallback (10x slower). */
float cfbnn_float_clamp = 13.14f;
double cfbnn_double_clamp = 37.5;
static const float KT = 4.0f;

template <int N>
INLINE float poly(const float (&c)[N], float t) {
  float p = c[N - 1];
#pragma GCC unroll 16
  for (int k = N - 2; k >= 0; k--) p = fmaf(p, t, c[k]);
  return p;
}

/* From the standardized distance xd (float64, so that x^2/2 keeps its digits): the clamped
   x, phi(x) (exp of a two-float argument) and J_0..J_KM. */
template <int KM>
INLINE void ftail_x(float x_raw, float dx_raw, float x_clamp, float& xo, float& pdf, float (&J)[KM + 1]) {
  // Every lane evaluates expf on the clamped x, and the result is masked by a multiplication:
  // with a select, the compiler may hoist expf to the unclamped x, whose underflow sends the
  // vector expf to its (very slow) scalar fallback.
  const bool in = x_raw < x_clamp;
  const float live = in ? 1.0f : 0.0f;
  float x = in ? x_raw : x_clamp;
  float dx = in ? dx_raw : 0.0f;  // (x + dx is the distance to ~1e-14: x^2/2 keeps its digits)
  float ahi = 0.5f * x * x;
  float alo = fmaf(0.5f * x, x, -ahi) + x * dx;
  float e = expf(-ahi) * (1.0f - alo) * INV_SQRT_2PI_F;
  pdf = e * live;
  float inv = 1.0f / (x + KT);
  float t = (x - KT) * inv;
  float p = inv;
  J[0] = poly(JC0, t) * p;
  if (KM >= 1) { p *= inv; J[1] = poly(JC1, t) * p; }
  if (KM >= 2) { p *= inv; J[2] = 2.0f * (poly(JC2, t) * p); }
  if (KM >= 3) { p *= inv; J[3] = 6.0f * (poly(JC3, t) * p); }
  if (KM >= 4) { p *= inv; J[4] = 24.0f * (poly(JC4, t) * p); }
  xo = x;
}

/* The standardized distance |d|/std in float32 as x + dx (dx from the exact fma residual),
   with the std == 0 limit (T_MAX). */
INLINE void fdistance(float ad, float s, float& x, float& dx) {
  float ss = s > FTINY ? s : FTINY;
  float inv = 1.0f / ss;
  float q = ad * inv;
  float r = fmaf(-q, ss, ad);
  bool ok = q < (float)T_MAX;
  x = ok ? q : (float)T_MAX;
  dx = ok ? r * inv : 0.0f;
}

template <int KM>
INLINE void ftail(double xd, double xf_clamp, float& xo, float& pdf, float (&J)[KM + 1]) {
  float x = (float)xd;
  ftail_x<KM>(x, (float)(xd - (double)x), (float)xf_clamp, xo, pdf, J);
}

/* ------------------------------------------------------------ float64 small tails */

/* Scalar continued fraction (rare fixups), in log space so that an underflowing
   Phi_N(-x) does not take a representable s^k u_k with it: S[k] = s^k u_k(x). Returns phi(x). */
static double tail_cf(double x, double s, int K, double* S) {
  int kr = K > 0 ? K : 1;
  int extra = x <= 3.0 ? 80 : (x <= 4.5 ? 64 : (x <= 8.0 ? 40 : 24));
  int depth = kr + extra;
  double r[MAX_K + 2];
  double ratio = 0.5 * (sqrt(x * x + 4.0 * (depth + 1)) - x);
  for (int j = depth; j >= 1; j--) {
    ratio = j / (x + ratio);
    if (j <= kr) r[j] = ratio;
  }
  double log_pdf = -0.5 * x * x + LOG_INV_SQRT_2PI;
  double lg = log_pdf - log(x + r[1]);
  S[0] = exp(lg);
  double ls = log(s);
  for (int k = 1; k <= K; k++) {
    lg += ls + log(r[k]);
    S[k] = exp(lg);
  }
  return exp(log_pdf);
}

/* Vectorized continued fraction for cnt gathered elements of one band (one depth):
   Miller's backward evaluation of r_j = j / (x + r_{j+1}), then u_0 = phi(x)/(x + r_1),
   S_k = s^k u_0 r_1 ... r_k (gaussian._continued_fraction). */
static void cf_batch(int cnt, int K, int depth, const double* RS x, const double* RS s, double** S, double* RS pdf) {
  alignas(64) double ratio[NB];
  alignas(64) double r[MAX_K + 1][NB];
  const int kr = K > 0 ? K : 1;
  for (int e = 0; e < cnt; e++) ratio[e] = 0.5 * (sqrt(x[e] * x[e] + 4.0 * (depth + 1)) - x[e]);
  for (int j = depth; j > kr; j--) {
    const double jd = (double)j;
#pragma omp simd
    for (int e = 0; e < cnt; e++) ratio[e] = jd / (x[e] + ratio[e]);
  }
  for (int j = kr; j >= 1; j--) {
    const double jd = (double)j;
#pragma omp simd
    for (int e = 0; e < cnt; e++) {
      ratio[e] = jd / (x[e] + ratio[e]);
      r[j][e] = ratio[e];
    }
  }
#pragma omp simd
  for (int e = 0; e < cnt; e++) {
    double p = exp(-0.5 * x[e] * x[e]) * INV_SQRT_2PI;
    pdf[e] = p;
    S[0][e] = p / (x[e] + r[1][e]);
  }
  for (int k = 1; k <= K; k++) {
#pragma omp simd
    for (int e = 0; e < cnt; e++) S[k][e] = S[k - 1][e] * (s[e] * r[k][e]);
  }
}

/* Compact the elements of a block whose distance needs the continued fraction, band by
   band, and hand them to fix(cnt, idx, depth). */
template <typename F>
INLINE void for_cf_bands(int nb, const double* RS xb, double limit, int K, F fix, const int* extra = BAND_EXTRA) {
  int beyond = 0;
#pragma omp simd reduction(+ : beyond)
  for (int i = 0; i < nb; i++) beyond += xb[i] > limit;
  if (!beyond) return;
  int idx[NB];
  for (int band = 0; band < 4; band++) {
    double lo = BAND_EDGES[band] > limit ? BAND_EDGES[band] : limit, hi = BAND_EDGES[band + 1];
    if (!(hi > lo)) continue;
    int cnt = 0;
    for (int i = 0; i < nb; i++) {  // branch-free compaction
      idx[cnt] = i;
      cnt += (xb[i] > lo) & (xb[i] <= hi);
    }
    if (cnt) fix(cnt, idx, (K > 0 ? K : 1) + extra[band]);
  }
}

/* ------------------------------------------------------------ block helpers */

/* The last, partial block runs the same (fully vectorized) code on a padded copy, so that
   every element takes the same instructions wherever it sits (bitwise reproducible). */
template <typename T, int NO>
struct PaddedBlock {
  int64_t lo, hi, n_real, off;
  const T* m; const T* s;
  T* outputs[NO];
  T* dst[NO];
  alignas(64) T bm[NB];
  alignas(64) T bs[NB];
  alignas(64) T bo[NO][NB];
  PaddedBlock(int64_t lo_, int64_t hi_, const T* m_, const T* s_, std::initializer_list<T*> outs) {
    int q = 0;
    for (T* p : outs) dst[q++] = p;
    if (hi_ - lo_ == NB) {
      lo = lo_; hi = hi_; m = m_; s = s_; off = -1; n_real = NB;
      for (int k = 0; k < NO; k++) outputs[k] = dst[k];
      return;
    }
    n_real = hi_ - lo_; off = lo_;
    for (int i = 0; i < NB; i++) {
      bm[i] = i < n_real ? m_[lo_ + i] : (T)0;
      bs[i] = i < n_real ? s_[lo_ + i] : (T)1;
    }
    m = bm; s = bs; lo = 0; hi = NB;
    for (int k = 0; k < NO; k++) outputs[k] = dst[k] ? bo[k] : nullptr;
  }
  void finish() {
    if (off < 0) return;
    for (int k = 0; k < NO; k++)
      if (dst[k]) memcpy(dst[k] + off, bo[k], sizeof(T) * (size_t)n_real);
  }
};

template <typename T>
INLINE void load_grad(const T* src, int scalar, int64_t off, int n, T* RS dst) {
  if (!src) {
    for (int i = 0; i < n; i++) dst[i] = (T)0;
  } else if (scalar) {
    T v = src[0];
    for (int i = 0; i < n; i++) dst[i] = v;
  } else {
    memcpy(dst, src + off, sizeof(T) * (size_t)n);
  }
}

/* f(lo, k) for each block [lo, lo + k) of NB elements of [0, n), the blocks shared statically among
   nthreads (one thread below PAR_MIN elements), float denormals flushed in each thread. */
template <typename T, typename F>
INLINE void for_each_block(int64_t n, int nthreads, F f) {
  const int64_t nblocks = (n + NB - 1) / NB;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN)
  {
    FlushDenormals ftz(sizeof(T) == sizeof(float));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      const int64_t lo = blk * NB;
      f(lo, (int)(lo + NB < n ? NB : n - lo));
    }
  }
}

/* One block of a backward pass from the partials (pm, ps, vm, vs) = d(Phi, Var)/d(mean, std) and
   the gradients gp, gu, gv of the outputs (Phi, Ups, Var) at offset off: with Ups = Var + Phi^2,
   d/dmean = pm (gp + 2 Phi gu) + vm (gu + gv), and d/dstd the same with ps, vs. */
template <typename T>
INLINE void partials_block(int64_t off, int k, const T* RS ff, const T* RS pm, const T* RS ps, const T* RS vm,
                           const T* RS vs, const T* gp, int gp_scalar, const T* gu, int gu_scalar, const T* gv,
                           int gv_scalar, T* RS om, T* RS os) {
  alignas(64) T bp[NB], bu[NB], bv[NB];
  load_grad(gp, gp_scalar, off, k, bp);
  load_grad(gu, gu_scalar, off, k, bu);
  load_grad(gv, gv_scalar, off, k, bv);
#pragma omp simd
  for (int i = 0; i < k; i++) {
    T A = bp[i] + (T)2 * ff[i] * bu[i], B = bu[i] + bv[i];
    om[i] = pm[i] * A + vm[i] * B;
    os[i] = ps[i] * A + vs[i] * B;
  }
}

/* ------------------------------------------------------------ combine formulas (any float type) */

/* (Phi, Var) and the partial derivatives of leaky relu (relu: eps = 0) from the small tail
   S_1 = E[w 1{w>0}], S_2 = E[w^2 1{w>0}], w ~ N(-|mean|, std^2), u0 = P(w > 0), pdf = phi(t)
   (activations.py: LeakyReLU). Var is not clamped here. */
template <typename R>
INLINE void leaky_combine(R m, R s, R u0, R S1, R S2, R pdf, R eps,
                          R& phi, R& var, R& pm, R& ps, R& vm, R& vs) {
  R s2 = s * s, om = (R)1 - eps;
  bool up = m >= (R)0;
  // mean >= 0: g - mean = (z - mean) + (eps - 1) z 1{z<0};  mean < 0: g - eps mean = eps (z - mean) + (1-eps) z 1{z>0}
  R phi_up = m + om * S1;
  R sec_up = s2 + (R)2 * (eps - (R)1) * (S2 + m * S1) + om * om * S2;
  R phi_lo = eps * m + om * S1;
  R sec_lo = eps * eps * s2 + (R)2 * eps * om * (S2 - m * S1) + om * om * S2;
  phi = up ? phi_up : phi_lo;
  var = (up ? sec_up : sec_lo) - om * om * S1 * S1;
  R cdf = up ? (R)1 - u0 : u0;     // Phi_N(mean/std)
  R cdfn = up ? u0 : (R)1 - u0;    // Phi_N(-mean/std)
  pm = eps + om * cdf;             // E[g']
  ps = om * pdf;                   // std E[g''] (heat equation)
  // dVar/dmean = 2 Cov(g, g') = 2 (1-eps) Cov(g, 1{z>0}), written without cancellation
  vm = (R)2 * om * (up ? eps * S1 + u0 * phi : S1 * ((R)1 - om * u0) - eps * m * u0);
  // dVar/dstd = std E[(g^2)''] - 2 Phi std E[g''] = 2 std E[g'^2] - 2 (1-eps) Phi phi(t)
  vs = (R)2 * s * (eps * eps * cdfn + cdf) - (R)2 * om * phi * pdf;
}

/* From the small tail S_0..S_4 (activations.py: ReLUSquared) and the truncated moments
   M_k = E[z^k 1{z>0}]: dPhi/dmean = 2 M_1, dPhi/dstd = 2 std M_0, dVar/dmean = 4 (M_3 - M_2 M_1),
   dVar/dstd = 4 std M_2 (3 - M_0) (heat equation: dM_k/dstd = std k (k-1) M_{k-2}). */
template <typename R>
INLINE void relusq_combine(R m, R s, R S0, R S1, R S2, R S3, R S4,
                           R& phi, R& var, R& pm, R& ps, R& vm, R& vs) {
  bool up = m >= (R)0;
  R v = s * s, msq = m * m;
  // mean >= 0: g - mean^2 = (z^2 - mean^2) - z^2 1{z<0}
  R phi_up = msq + v - S2;
  R var_up = (R)4 * msq * v + (R)2 * v * v + (R)2 * v * S2 - S2 * S2 - S4 + (R)2 * msq * S2;
  R var_lo = S4 - S2 * S2;
  phi = up ? phi_up : S2;
  var = up ? var_up : var_lo;
  R M0 = up ? (R)1 - S0 : S0, M1 = up ? m + S1 : S1;
  R cov_up = (R)2 * m * v + S3 + m * S2 - (msq + v) * S1 + S1 * S2;  // M_3 - M_2 M_1
  R cov_lo = S3 - S2 * S1;
  pm = (R)2 * M1;
  ps = (R)2 * s * M0;
  vm = (R)4 * (up ? cov_up : cov_lo);
  vs = (R)4 * s * phi * ((R)3 - M0);
}

/* kind: 0 relu, 1 leaky relu, 2 relu squared. Outputs o[0..6] = phi, ups, var, then the saved
   factors: relu (u0, pdf), the others (dPhi/dmean, dPhi/dstd, dVar/dmean, dVar/dstd). */
template <typename T>
struct Outs {
  T *phi, *ups, *var, *a, *b, *c, *d;
};

template <typename T, typename R>
INLINE void store_outputs(int kind, bool var_out, bool save, int64_t i, R phi, R var_raw,
                          R pm, R ps, R vm, R vs, R u0, R pdf, T* RS o0, T* RS o1, T* RS o2, T* RS o3, T* RS o4,
                          T* RS o5, T* RS o6) {
  R v = var_raw > (R)0 ? var_raw : (R)0;
  T pf = (T)phi, vf = (T)v;
  o0[i] = pf;
  o1[i] = (T)((R)vf + (R)pf * (R)pf);
  if (var_out) o2[i] = vf;
  if (save) {
    if (kind == 0) {
      o3[i] = (T)u0;
      o4[i] = (T)pdf;
    } else {  // Activation.moments clamps Var with clamp_min: no gradient where it bites
      R keep = var_raw < (R)0 ? (R)0 : (R)1;
      o3[i] = (T)pm;
      o4[i] = (T)ps;
      o5[i] = (T)(keep * vm);
      o6[i] = (T)(keep * vs);
    }
  }
}
#define OUTS_ARGS o.phi, o.ups, o.var, o.a, o.b, o.c, o.d

/* ------------------------------------------------------------ relu / leaky / relu^2: float32 */

enum { MODE_FULL = 0, MODE_MEAN = 1, MODE_FACTORS = 2 };  // all outputs / Phi only / relu's (u0, pdf) only

template <int KIND, bool VAR, bool SAVE, int MODE>
static int act_f32_range(int64_t lo, int64_t hi, const float* RS m, const float* RS s, float eps, Outs<float> o) {
  constexpr int KM = KIND == 2 ? 4 : 2;
  float* RS o0 = o.phi; float* RS o1 = o.ups; float* RS o2 = o.var; float* RS o3 = o.a; float* RS o4 = o.b;
  float* RS o5 = o.c; float* RS o6 = o.d;
  const float xf_clamp = cfbnn_float_clamp;
  int fixups = 0;
#pragma omp simd reduction(+ : fixups)
  for (int64_t i = lo; i < hi; i++) {
    float mi = m[i], si = s[i];
    float xr, dxr;
    fdistance(fabsf(mi), si, xr, dxr);
    fixups += (mi < 0.0f) & (si > 1.0f) & (xr >= xf_clamp);
    float x, pdf, J[KM + 1];
    ftail_x<KM>(xr, dxr, xf_clamp, x, pdf, J);
    float sp = si * pdf;  // std phi(x): multiplied first so that a large std keeps a tiny tail
    if (KIND == 0) {
      float u1 = pdf * J[1], u2 = pdf * J[2];
      float tail = sp * J[1];  // E[w 1{w>0}]
      bool up = mi >= 0.0f;
      float phi = up ? (tail != 0.0f ? mi + tail : mi) : tail;
      if (MODE == MODE_MEAN) {
        o0[i] = phi;
      } else if (MODE == MODE_FACTORS) {
        o3[i] = pdf * J[0];
        o4[i] = pdf;
      } else {
        float vu = si * si * (1.0f - u2 - 2.0f * x * u1 - u1 * u1);
        float vl = si * (sp * (J[2] - pdf * J[1] * J[1]));
        float v = up ? vu : vl;
        v = v > 0.0f ? v : 0.0f;
        o0[i] = phi;
        o1[i] = fmaf(phi, phi, v);
        if (VAR) o2[i] = v;
        if (SAVE) {
          o3[i] = pdf * J[0];
          o4[i] = pdf;
        }
      }
    } else if (KIND == 1) {
      float phi, var, pm, ps, vm, vs;
      leaky_combine<float>(mi, si, pdf * J[0], sp * J[1], (si * sp) * J[2], pdf, eps, phi, var, pm, ps, vm, vs);
      store_outputs<float, float>(1, VAR, SAVE, i, phi, var, pm, ps, vm, vs, 0.0f, pdf, o0, o1, o2, o3, o4, o5, o6);
    } else {
      float phi, var, pm, ps, vm, vs;
      // std^k phi(x) before J_k: a tail below FLT_MIN times a large std^k can be a normal result
      const float s2p = si * sp, s3p = si * s2p, s4p = si * s3p;
      relusq_combine<float>(mi, si, pdf * J[0], sp * J[1], s2p * J[2], s3p * J[KM >= 3 ? 3 : 0], s4p * J[KM],
                            phi, var, pm, ps, vm, vs);
      store_outputs<float, float>(2, VAR, SAVE, i, phi, var, pm, ps, vm, vs, 0.0f, pdf, o0, o1, o2, o3, o4, o5, o6);
    }
  }
  return fixups;
}

/* Beyond XF the float32 tail is 0; with std > 1 a lower-side result can still be a normal
   float32: recompute those (rare) elements in float64 with the continued fraction. */
template <int KIND, bool VAR, bool SAVE, int MODE>
static void act_f32_fixup(int64_t lo, int64_t hi, const float* RS m, const float* RS s, float eps, Outs<float> o) {
  int64_t idx[NB];
  int cnt = 0;
  const float xf_clamp = cfbnn_float_clamp;
  for (int64_t i = lo; i < hi; i++) {  // branch-free compaction (the main loop's test)
    float xr, dxr;
    fdistance(fabsf(m[i]), s[i], xr, dxr);
    idx[cnt] = i;
    cnt += (m[i] < 0.0f) & (s[i] > 1.0f) & (xr >= xf_clamp);
  }
  for (int q = 0; q < cnt; q++) {
    int64_t i = idx[q];
    float mi = m[i], si = s[i];
    double x = distance((double)fabsf(mi), (double)si);
    double md = mi, sd = si, S[5];
    double pdf = tail_cf(x, sd, KIND == 2 ? 4 : 2, S);
    double phi, var, pm, ps, vm, vs;
    if (KIND == 2) relusq_combine<double>(md, sd, S[0], S[1], S[2], S[3], S[4], phi, var, pm, ps, vm, vs);
    else leaky_combine<double>(md, sd, S[0], S[1], S[2], pdf, KIND == 0 ? 0.0 : (double)eps, phi, var, pm, ps, vm, vs);
    if (MODE == MODE_MEAN) {
      o.phi[i] = (float)phi;
    } else if (MODE == MODE_FACTORS) {
      o.a[i] = (float)S[0];
      o.b[i] = (float)pdf;
    } else {
      store_outputs<float, double>(KIND, VAR, SAVE, i, phi, var, pm, ps, vm, vs, S[0], pdf, OUTS_ARGS);
    }
  }
}

/* ------------------------------------------------------------ relu / leaky / relu^2: float64 */

template <int KIND, bool VAR, bool SAVE, int MODE>
INLINE void act_f64_combine_store(int64_t i, double mi, double si, double u0, double S1, double S2, double S3, double S4,
                                  double pdf, double eps, double* RS o0, double* RS o1, double* RS o2, double* RS o3,
                                  double* RS o4, double* RS o5, double* RS o6) {
  double phi, var, pm, ps, vm, vs;
  if (KIND == 2) relusq_combine<double>(mi, si, u0, S1, S2, S3, S4, phi, var, pm, ps, vm, vs);
  else leaky_combine<double>(mi, si, u0, S1, S2, pdf, KIND == 0 ? 0.0 : eps, phi, var, pm, ps, vm, vs);
  if (MODE == MODE_MEAN) {
    o0[i] = phi;
  } else if (MODE == MODE_FACTORS) {
    o3[i] = u0;
    o4[i] = pdf;
  } else {
    store_outputs<double, double>(KIND, VAR, SAVE, i, phi, var, pm, ps, vm, vs, u0, pdf, o0, o1, o2, o3, o4, o5, o6);
  }
}

template <int KIND, bool VAR, bool SAVE, int MODE>
static void act_f64_range(int64_t lo, int64_t hi, const double* RS m, const double* RS s, double eps, Outs<double> o) {
  constexpr int K = KIND == 2 ? 4 : 2;
  double* RS o0 = o.phi; double* RS o1 = o.ups; double* RS o2 = o.var; double* RS o3 = o.a; double* RS o4 = o.b;
  double* RS o5 = o.c; double* RS o6 = o.d;
  alignas(64) double xb[NB];
  const int nb = (int)(hi - lo);
  const double x_clamp = cfbnn_double_clamp;
#pragma omp simd
  for (int k = 0; k < nb; k++) {
    int64_t i = lo + k;
    double mi = m[i], si = s[i];
    double x = distance(fabs(mi), si);
    xb[k] = x;
    double xc = x < x_clamp ? x : x_clamp;
    double live = x < x_clamp ? 1.0 : 0.0;
    double u0 = live * (0.5 * erfc(xc * INV_SQRT2));
    double pdf = live * exp(-0.5 * xc * xc + LOG_INV_SQRT_2PI);
    double u1 = pdf - xc * u0;
    double u2 = u0 - xc * u1;
    double u3 = 2.0 * u1 - xc * u2;
    double u4 = 3.0 * u2 - xc * u3;
    double s2 = si * si;
    act_f64_combine_store<KIND, VAR, SAVE, MODE>(i, mi, si, u0, si * u1, s2 * u2, K >= 3 ? s2 * si * u3 : 0.0,
                                                      K >= 4 ? s2 * s2 * u4 : 0.0, pdf, eps, o0, o1, o2, o3, o4, o5, o6);
  }
  // continued fraction where the recursion loses digits
  for_cf_bands(nb, xb, recursion_limit(K), K, [&](int cnt, const int* idx, int depth) {
    alignas(64) double gx[NB], gs[NB], gm[NB], pdf[NB], Sb[K + 1][NB];
    double* S[K + 1];
    for (int k = 0; k <= K; k++) S[k] = Sb[k];
    for (int c = 0; c < cnt; c++) {
      gx[c] = xb[idx[c]];
      gs[c] = s[lo + idx[c]];
      gm[c] = m[lo + idx[c]];
    }
    cf_batch(cnt, K, depth, gx, gs, S, pdf);
    for (int c = 0; c < cnt; c++)
      act_f64_combine_store<KIND, VAR, SAVE, MODE>(lo + idx[c], gm[c], gs[c], S[0][c], S[1][c], S[2][c],
                                                        K >= 3 ? S[3][c] : 0.0, K >= 4 ? S[4][c] : 0.0, pdf[c], eps,
                                                        o.phi, o.ups, o.var, o.a, o.b, o.c, o.d);
  });
}

/* ------------------------------------------------------------ drivers */

/* A NaN mean or standard deviation makes every output of its element NaN. The arithmetic above
   would not always say so: the distance's clamp and the tail's selects turn a NaN into a
   finite far-tail value (a NaN input to a network then gave a finite ELBO). One vectorized
   count per block; the rare blocks with a NaN are patched. */
template <typename T>
static void propagate_nan(int64_t lo, int64_t hi, const T* RS m, const T* RS s, Outs<T> o) {
  int nans = 0;
#pragma omp simd reduction(+ : nans)
  for (int64_t i = lo; i < hi; i++) nans += (m[i] != m[i]) | (s[i] != s[i]);
  if (!nans) return;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  T* outs[7] = {o.phi, o.ups, o.var, o.a, o.b, o.c, o.d};
  for (int64_t i = lo; i < hi; i++) {
    if (m[i] == m[i] && s[i] == s[i]) continue;
    for (T* out : outs)
      if (out) out[i] = nan;
  }
}

/* The same over whole arrays, for the piecewise polynomials' kernels (one pass of counting). */
template <typename T>
static void propagate_nan_all(int64_t n, const T* m, const T* s, std::initializer_list<T*> outputs) {
  Outs<T> o = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  T** slots[7] = {&o.phi, &o.ups, &o.var, &o.a, &o.b, &o.c, &o.d};
  int q = 0;
  for (T* out : outputs) *slots[q++] = out;
  propagate_nan<T>(0, n, m, s, o);
}

template <int KIND, bool VAR, bool SAVE, int MODE>
INLINE void act_range(int64_t lo, int64_t hi, const float* m, const float* s, double eps, Outs<float> o) {
  if (act_f32_range<KIND, VAR, SAVE, MODE>(lo, hi, m, s, (float)eps, o))
    act_f32_fixup<KIND, VAR, SAVE, MODE>(lo, hi, m, s, (float)eps, o);
  propagate_nan<float>(lo, hi, m, s, o);
}
template <int KIND, bool VAR, bool SAVE, int MODE>
INLINE void act_range(int64_t lo, int64_t hi, const double* m, const double* s, double eps, Outs<double> o) {
  act_f64_range<KIND, VAR, SAVE, MODE>(lo, hi, m, s, eps, o);
  propagate_nan<double>(lo, hi, m, s, o);
}

template <typename T, int KIND, bool VAR, bool SAVE, int MODE>
INLINE void act_block(int64_t lo, int64_t hi, const T* m, const T* s, double eps, T* const* outs) {
  PaddedBlock<T, 7> pad(lo, hi, m, s, {outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6]});
  Outs<T> o = {pad.outputs[0], pad.outputs[1], pad.outputs[2], pad.outputs[3], pad.outputs[4], pad.outputs[5],
               pad.outputs[6]};
  act_range<KIND, VAR, SAVE, MODE>(pad.lo, pad.hi, pad.m, pad.s, eps, o);
  pad.finish();
}

template <typename T, int KIND>
static void act_forward(int64_t n, const T* m, const T* s, double eps, T* phi, T* ups, T* var,
                        T* a, T* b, T* c, T* d, int nthreads, bool mean_only) {
  bool save = a != nullptr, vo = var != nullptr;
  T* outs[7] = {phi, ups, var, a, b, c, d};
  for_each_block<T>(n, nthreads, [&](int64_t lo, int k) {
    const int64_t hi = lo + k;
    if (mean_only) act_block<T, KIND, false, false, MODE_MEAN>(lo, hi, m, s, eps, outs);
    else if (save && vo) act_block<T, KIND, true, true, MODE_FULL>(lo, hi, m, s, eps, outs);
    else if (save) act_block<T, KIND, false, true, MODE_FULL>(lo, hi, m, s, eps, outs);
    else if (vo) act_block<T, KIND, true, false, MODE_FULL>(lo, hi, m, s, eps, outs);
    else act_block<T, KIND, false, false, MODE_FULL>(lo, hi, m, s, eps, outs);
  });
}

/* Backward of relu. The Gaussian factors u0 = Phi_N(-|t|) and pdf = phi(t) are recomputed per
   block (cheaper than saving them: no extra buffers to allocate, write and read back), then
   dPhi/dmean = Phi_N(t), dPhi/dstd = phi(t), dVar/dmean = 2 Phi Phi_N(-t),
   dVar/dstd = 2 (std Phi_N(t) - Phi phi(t)); Ups = Var + Phi^2. */
template <typename T>
static void relu_backward(int64_t n, const T* m, const T* s, const T* phi,
                          const T* gp, int gp_scalar, const T* gu, int gu_scalar, const T* gv, int gv_scalar,
                          T* o_gm, T* o_gs, int nthreads) {
  const bool dense = gp && gu && !gp_scalar && !gu_scalar && !gv;  // the common case: a loss of Phi and Upsilon
  for_each_block<T>(n, nthreads, [&](int64_t lo, int k) {
    alignas(64) T fu0[NB], fpdf[NB];
    T* outs[7] = {nullptr, nullptr, nullptr, fu0, fpdf, nullptr, nullptr};
    act_block<T, 0, false, true, MODE_FACTORS>(0, k, m + lo, s + lo, 0.0, outs);
    alignas(64) T bp[NB], bu[NB], bv[NB];
    const T* RS gpp;
    const T* RS gup;
    const T* RS gvp;
    if (dense) {
      gpp = gp + lo;
      gup = gu + lo;
      gvp = bv;
      for (int i = 0; i < k; i++) bv[i] = (T)0;
    } else {
      load_grad(gp, gp_scalar, lo, k, bp);
      load_grad(gu, gu_scalar, lo, k, bu);
      load_grad(gv, gv_scalar, lo, k, bv);
      gpp = bp; gup = bu; gvp = bv;
    }
    const T* RS mm = m + lo; const T* RS ss = s + lo; const T* RS ff = phi + lo;
    T* RS om = o_gm + lo; T* RS os = o_gs + lo;
#pragma omp simd
    for (int i = 0; i < k; i++) {
      T f = ff[i], q = fu0[i], p = fpdf[i], si = ss[i];
      bool up = mm[i] >= (T)0;
      T cdf = up ? (T)1 - q : q, cdfn = up ? q : (T)1 - q;
      T A = gpp[i] + (T)2 * f * gup[i], B = gup[i] + gvp[i];
      om[i] = cdf * A + (T)2 * f * cdfn * B;
      os[i] = p * A + (T)2 * (si * cdf - f * p) * B;
    }
  });
}

/* Backward of leaky relu and relu^2 (kind 1, 2): the four partials recomputed per block by the
   forward kernel into scratch (no saved buffers), then combined with the output gradients. */
template <typename T, int KIND>
static void act_backward(int64_t n, const T* m, const T* s, double eps, const T* phi,
                         const T* gp, int gp_scalar, const T* gu, int gu_scalar, const T* gv, int gv_scalar,
                         T* o_gm, T* o_gs, int nthreads) {
  for_each_block<T>(n, nthreads, [&](int64_t lo, int k) {
    alignas(64) T f0[NB], f1[NB], pm[NB], ps[NB], vm[NB], vs[NB];
    T* outs[7] = {f0, f1, nullptr, pm, ps, vm, vs};
    act_block<T, KIND, false, true, MODE_FULL>(0, k, m + lo, s + lo, eps, outs);
    partials_block<T>(lo, k, phi + lo, pm, ps, vm, vs, gp, gp_scalar, gu, gu_scalar, gv, gv_scalar, o_gm + lo,
                      o_gs + lo);
  });
}

/* Backward from saved partials (pm, ps, vm, vs) = d(Phi, Var)/d(mean, std); Ups = Var + Phi^2. */
template <typename T>
static void partials_backward(int64_t n, const T* phi, const T* pm, const T* ps, const T* vm, const T* vs,
                              const T* gp, int gp_scalar, const T* gu, int gu_scalar, const T* gv, int gv_scalar,
                              T* o_gm, T* o_gs, int nthreads) {
  for_each_block<T>(n, nthreads, [&](int64_t lo, int k) {
    partials_block<T>(lo, k, phi + lo, pm + lo, ps + lo, vm + lo, vs + lo, gp, gp_scalar, gu, gu_scalar, gv,
                      gv_scalar, o_gm + lo, o_gs + lo);
  });
}

/* Number of negative entries (input validation, without a temporary). */
template <typename T>
static int64_t count_negative(int64_t n, const T* s, int nthreads) {
  int64_t bad = 0;
  const int64_t chunk = 1 << 16;
  const int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for reduction(+ : bad) num_threads(nthreads) if (nthreads > 1 && n >= 8 * chunk)
  for (int64_t c = 0; c < nchunks; c++) {
    const T* RS p = s + c * chunk;
    const int len = (int)(c * chunk + chunk < n ? chunk : n - c * chunk);
    int count = 0;
#pragma omp simd reduction(+ : count)
    for (int i = 0; i < len; i++) count += p[i] < (T)0;
    bad += count;
  }
  return bad;
}

/* ------------------------------------ the last hidden layer and a one-output Normal ELL */

/* The activation's moments and the output layer integrated exactly, for a (rows, H) block of
   pre-activation means m and variances s (the standard deviation is taken here) and one output with column weights w_phi = loc_c, w_var =
   loc_c^2, w_ups = Var W_c (bnn/fused/normal_ell.py, eqs. (7)-(9)):

   forward:   mean_r = sum_c Phi_rc w_phi_c,  spread_r = sum_c (Var_rc w_var_c + Ups_rc w_ups_c);
   backward:  for dL/d mean_r = u_r and dL/d spread_r = k_r, the gradients of (m, s) (mean, variance)
              from dL/dPhi = u_r w_phi_c, dL/dUps = k_r w_ups_c, dL/dVar = k_r w_var_c,
              and the column sums sum_r u_r Phi_rc, sum_r k_r Var_rc, sum_r k_r Ups_rc.

   Phi, Ups, Var and the partials live in L1 scratch only: nothing (rows, H)-sized is written
   but the two gradients. Each thread owns whole rows (no races on the row sums); the column
   sums are float64 per thread, added in thread order. */
INLINE float tail_sqrt(float x) { return sqrtf(x); }
INLINE double tail_sqrt(double x) { return sqrt(x); }

/* d/d mean and d/d variance of a loss from A = dL/dPhi + 2 Phi dL/dUps and B = dL/dUps + dL/dVar
   (Ups = Var + Phi^2), given the block's saved factors: relu's u0 = Phi_N(-|t|) and pdf = phi(t) in
   (a, b), as relu_backward; the others' partials d(Phi, Var)/d(mean, std) in (a, b, c, d). The
   standard deviation sd's gradient becomes the variance's: d std / d variance = 1 / (2 std). */
template <typename T, int KIND>
INLINE void variance_gradients(T A, T B, T phi, T mean, T sd, T a, T b, T c, T d, T& grad_mean, T& grad_variance) {
  T grad_std;
  if (KIND == 0) {
    const bool up = mean >= (T)0;
    const T cdf = up ? (T)1 - a : a, cdfn = up ? a : (T)1 - a;
    grad_mean = cdf * A + (T)2 * phi * cdfn * B;
    grad_std = b * A + (T)2 * (sd * cdf - phi * b) * B;
  } else {
    grad_mean = a * A + c * B;
    grad_std = b * A + d * B;
  }
  grad_variance = grad_std / ((T)2 * sd);
}

/* A row segment's two sums from its moments (f Phi, u Ups, v Var) and the columns' weights. */
template <typename T>
INLINE void segment_sums(int64_t len, const T* RS ff, const T* RS uu, const T* RS vv, const T* RS wp,
                         const T* RS wv, const T* RS wu, T& mean_sum, T& spread_sum) {
  T sm = (T)0, ss = (T)0;
#pragma omp simd reduction(+ : sm, ss)
  for (int64_t j = 0; j < len; j++) {
    sm += ff[j] * wp[j];
    ss += vv[j] * wv[j] + uu[j] * wu[j];
  }
  mean_sum = sm;
  spread_sum = ss;
}

/* A row segment's gradients (into om, os) for its row's gradients (ru, rk), from its moments, the
   block's saved factors p[0..3] (variance_gradients' a, b, c, d), means mm and standard deviations
   ssd; its column sums (ru Phi, rk Var, rk Ups) added into cp, cv, cu. */
template <typename T, int KIND>
INLINE void segment_gradients(int64_t len, T ru, T rk, const T* RS ff, const T* RS uu, const T* RS vv,
                              const T* const* p, const T* RS mm, const T* RS ssd, const T* RS wp, const T* RS wv,
                              const T* RS wu, T* RS om, T* RS os, T* RS cp, T* RS cv, T* RS cu) {
  const T* RS aa = p[0]; const T* RS bb = p[1]; const T* RS cc = p[2]; const T* RS dd = p[3];
#pragma omp simd
  for (int64_t j = 0; j < len; j++) {
    const T fj = ff[j];
    const T gp = ru * wp[j], gu = rk * wu[j], gv = rk * wv[j];
    variance_gradients<T, KIND>(gp + (T)2 * fj * gu, gu + gv, fj, mm[j], ssd[j], aa[j], bb[j], cc[j], dd[j], om[j],
                                os[j]);
    cp[j] += ru * fj;
    cv[j] += rk * vv[j];
    cu[j] += rk * uu[j];
  }
}

/* The tail passes' threads: as many as asked from PAR_MIN elements on (else one); f(tid, r0, r1)
   on each, rows [r0, r1) split evenly, float denormals flushed. */
INLINE int row_team(int64_t n, int nthreads) { return (nthreads > 1 && n >= PAR_MIN) ? nthreads : 1; }

template <typename T, typename F>
INLINE void for_each_row_range(int64_t rows, int team_size, F f) {
#pragma omp parallel num_threads(team_size) if (team_size > 1)
  {
    FlushDenormals ftz(sizeof(T) == sizeof(float));
    int tid = 0, team = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num(); team = omp_get_num_threads();
#endif
    f(tid, rows * tid / team, rows * (tid + 1) / team);
  }
}

/* The threads' column sums (3 x H each, zero where a thread had no rows) added in thread order. */
template <typename T>
static void add_thread_columns(const T* partial, int team_size, int64_t H, double* o_cols) {
  for (int64_t j = 0; j < 3 * H; j++) {
    double total = 0.0;
    for (int t = 0; t < team_size; t++) total += (double)partial[3 * H * t + j];
    o_cols[j] = total;
  }
}

/* tail_pass's forward and backward (below): blocks of NB elements across the rows, in L1. */
template <typename T, int KIND>
static void tail_pass_blocks(bool backward, int64_t rows, int64_t H, const T* m, const T* s, double eps,
                      const T* w_phi, const T* w_var, const T* w_ups, const T* row_u, const T* row_k,
                      T* o_mean, T* o_spread, T* o_gm, T* o_gs, double* o_cols, int nthreads) {
  const int team_size = row_team(rows * H, nthreads);
  T* partial = nullptr;
  if (backward) partial = (T*)calloc((size_t)(3 * H * team_size), sizeof(T));
  for_each_row_range<T>(rows, team_size, [&](int tid, int64_t r0, int64_t r1) {
    T* RS cols = backward ? partial + 3 * H * tid : nullptr;
    for (int64_t r = r0; r < r1; r++) {
      if (!backward) { o_mean[r] = (T)0; o_spread[r] = (T)0; }
    }
    const int64_t end = r1 * H;
    for (int64_t lo = r0 * H; lo < end; lo += NB) {
      const int k = (int)(lo + NB < end ? NB : end - lo);
      alignas(64) T f[NB], u[NB], v[NB], a[NB], b[NB], c[NB], d[NB], sd[NB];
      T* outs[7] = {f, u, v, a, b, c, d};
      {  // the standard deviation from the variance, kept off exact zero (bnn/fused/support.py: sqrt_floored)
        const T* RS vin = s + lo;
        const T floor = sizeof(T) == sizeof(float) ? (T)FTINY : (T)TINY;
#pragma omp simd
        for (int j = 0; j < k; j++) sd[j] = tail_sqrt(vin[j] < floor ? floor : vin[j]);  // (a NaN stays NaN)
      }
      if (backward) act_block<T, KIND, true, true, MODE_FULL>(0, k, m + lo, sd, eps, outs);
      else act_block<T, KIND, true, false, MODE_FULL>(0, k, m + lo, sd, eps, outs);
      int i = 0;
      while (i < k) {  // one row's segment of the block at a time
        const int64_t g = lo + i, row = g / H, col0 = g - row * H;
        const int len = (int)(k - i < H - col0 ? k - i : H - col0);
        const T* RS wp = w_phi + col0; const T* RS wv = w_var + col0; const T* RS wu = w_ups + col0;
        const T* RS ff = f + i; const T* RS uu = u + i; const T* RS vv = v + i;
        if (!backward) {
          T sm, ss;
          segment_sums<T>(len, ff, uu, vv, wp, wv, wu, sm, ss);
          o_mean[row] += sm;
          o_spread[row] += ss;
        } else {
          const T* saved[4] = {a + i, b + i, c + i, d + i};
          segment_gradients<T, KIND>(len, row_u[row], row_k[row], ff, uu, vv, saved, m + g, sd + i, wp, wv, wu,
                                     o_gm + g, o_gs + g, cols + col0, cols + H + col0, cols + 2 * H + col0);
        }
        i += len;
      }
    }
  });
  if (backward) {
    add_thread_columns<T>(partial, team_size, H, o_cols);
    free(partial);
  }
}

/* tail_pass_blocks' forward and backward at once, for the Normal likelihood of the rows' targets y:
   a loss L = scale sum_r ELL_r (eq. (7); mean_bias the output bias's mean) has the row gradients
   u_r = scale beta residual_r and k_r = -scale beta / 2 (unit_u = scale beta, unit_k = -scale beta /
   2). The backward pass is taken in the forward one, from the same moments, so that a caller whose
   upstream gradient is one number g only scales by g (bnn/fused/operator_elbo.py). A row's residual
   needs its whole sum first: a group of whole rows at a time, their moments and partials computed in
   blocks of NB elements into scratch, then each row reduced and differentiated from it. */
static const int64_t TAIL_GROUP = 1024;  // elements of whole rows whose moments the scratch holds

template <typename T, int KIND>
static void tail_pass_ahead(int64_t rows, int64_t H, const T* m, const T* s, double eps, const T* w_phi,
                            const T* w_var, const T* w_ups, const T* y, double mean_bias, double unit_u,
                            double unit_k, T* o_mean, T* o_spread, T* o_gm, T* o_gs, double* o_cols, int nthreads) {
  const int team_size = row_team(rows * H, nthreads);
  const int64_t group_rows = H >= TAIL_GROUP || H == 0 ? 1 : TAIL_GROUP / H, cap = group_rows * H;
  T* partial = (T*)calloc((size_t)(3 * H * team_size + 1), sizeof(T));
  T* scratch = (T*)malloc(sizeof(T) * (size_t)(8 * cap * team_size + 1));
  for_each_row_range<T>(rows, team_size, [&](int tid, int64_t r0, int64_t r1) {
    T* RS cp = partial + 3 * H * tid; T* RS cv = cp + H; T* RS cu = cp + 2 * H;
    T* base = scratch + 8 * cap * tid;
    T *f = base, *u = base + cap, *v = base + 2 * cap, *a = base + 3 * cap, *b = base + 4 * cap,
      *c = base + 5 * cap, *d = base + 6 * cap, *sd = base + 7 * cap;
    const T floor = sizeof(T) == sizeof(float) ? (T)FTINY : (T)TINY;
    const T mb = (T)mean_bias, uu_unit = (T)unit_u, kk_unit = (T)unit_k;
    for (int64_t g0 = r0; g0 < r1; g0 += group_rows) {
      const int64_t g1 = g0 + group_rows < r1 ? g0 + group_rows : r1, lo = g0 * H, count = (g1 - g0) * H;
      for (int64_t q = 0; q < count; q += NB) {
        const int k = (int)(q + NB < count ? NB : count - q);
        {  // the standard deviation from the variance, kept off exact zero (bnn/fused/support.py: sqrt_floored)
          const T* RS vin = s + lo + q;
          T* RS out = sd + q;
#pragma omp simd
          for (int j = 0; j < k; j++) out[j] = tail_sqrt(vin[j] < floor ? floor : vin[j]);  // (a NaN stays NaN)
        }
        T* outs[7] = {f + q, u + q, v + q, a + q, b + q, c + q, d + q};
        act_block<T, KIND, true, true, MODE_FULL>(0, k, m + lo + q, sd + q, eps, outs);
      }
      for (int64_t row = g0; row < g1; row++) {  // (by row, not by element: a row of width 0 sums to 0)
        const int64_t o = (row - g0) * H;
        const T* RS ff = f + o; const T* RS uu = u + o; const T* RS vv = v + o;
        T sm, ss;
        segment_sums<T>(H, ff, uu, vv, w_phi, w_var, w_ups, sm, ss);
        o_mean[row] = sm;
        o_spread[row] = ss;
        // as normal_rows and normal_row_gradients, at dL/d ELL_r = scale
        const T ru = (y[row] - (sm + mb)) * uu_unit;
        const T* saved[4] = {a + o, b + o, c + o, d + o};
        segment_gradients<T, KIND>(H, ru, kk_unit, ff, uu, vv, saved, m + lo + o, sd + o, w_phi, w_var, w_ups,
                                   o_gm + lo + o, o_gs + lo + o, cp, cv, cu);
      }
    }
  });
  free(scratch);
  add_thread_columns<T>(partial, team_size, H, o_cols);
  free(partial);
}

/* The tail pass by mode: TAIL_FORWARD the two row sums, TAIL_BACKWARD for row gradients (row_u, row_k)
   the gradients of (m, s) and the column sums (tail_pass_blocks), TAIL_AHEAD both for the Normal
   likelihood's rows (tail_pass_ahead). */
enum { TAIL_FORWARD = 0, TAIL_BACKWARD = 1, TAIL_AHEAD = 2 };

template <typename T, int KIND>
static void tail_pass(int mode, int64_t rows, int64_t H, const T* m, const T* s, double eps, const T* w_phi,
                      const T* w_var, const T* w_ups, const T* row_u, const T* row_k, const T* y, double mean_bias,
                      double unit_u, double unit_k, T* o_mean, T* o_spread, T* o_gm, T* o_gs, double* o_cols,
                      int nthreads) {
  if (mode == TAIL_AHEAD)
    tail_pass_ahead<T, KIND>(rows, H, m, s, eps, w_phi, w_var, w_ups, y, mean_bias, unit_u, unit_k, o_mean, o_spread,
                             o_gm, o_gs, o_cols, nthreads);
  else
    tail_pass_blocks<T, KIND>(mode == TAIL_BACKWARD, rows, H, m, s, eps, w_phi, w_var, w_ups, row_u, row_k, o_mean,
                              o_spread, o_gm, o_gs, o_cols, nthreads);
}

/* A hidden layer's moments from pre-activation means m and *variances* v (the standard deviation
   taken here, kept off exact zero as bnn/fused/support.py's sqrt_floored): forward (Phi, Ups, Var) into
   o_phi, o_ups, o_var; backward, from dense gradients gp, gu, gv (any may be null: zero), the
   gradients of m and of v. What the moments kernels do after a square root, without the square
   root's two passes forward and its derivative's pass backward. With width > 0 (the n values
   being rows of that width) the forward pass writes Phi and Ups as rows of width + 1 ending in 1:
   [Phi, 1] and [Ups, 1], the next layer's inputs with its bias column (bnn/fused/). */
template <typename T, int KIND>
static void hidden_pass(bool backward, int64_t n, const T* m, const T* v, double eps, T* o_phi, T* o_ups, T* o_var,
                        const T* gp, const T* gu, const T* gv, T* o_gm, T* o_gv, int64_t width, int nthreads) {
  for_each_block<T>(n, nthreads, [&](int64_t lo, int k) {
    alignas(64) T sd[NB];
    {
      const T* RS vin = v + lo;
      const T floor = sizeof(T) == sizeof(float) ? (T)FTINY : (T)TINY;
#pragma omp simd
      for (int j = 0; j < k; j++) sd[j] = tail_sqrt(vin[j] < floor ? floor : vin[j]);  // (a NaN stays NaN)
    }
    if (!backward && width == 0) {
      T* outs[7] = {o_phi + lo, o_ups + lo, o_var + lo, nullptr, nullptr, nullptr, nullptr};
      act_block<T, KIND, true, false, MODE_FULL>(0, k, m + lo, sd, eps, outs);
      return;
    }
    if (!backward) {  // Phi and Ups as [Phi, 1], [Ups, 1]: rows of width + 1, the next layer's bias input
      alignas(64) T f[NB], u[NB];
      T* outs[7] = {f, u, o_var + lo, nullptr, nullptr, nullptr, nullptr};
      act_block<T, KIND, true, false, MODE_FULL>(0, k, m + lo, sd, eps, outs);
      int i = 0;
      while (i < k) {  // one row's segment of the block at a time
        const int64_t g = lo + i, row = g / width, col0 = g - row * width;
        const int len = (int)(k - i < width - col0 ? k - i : width - col0);
        T* RS pf = o_phi + row * (width + 1) + col0;
        T* RS pu = o_ups + row * (width + 1) + col0;
        const T* RS ff = f + i; const T* RS uu = u + i;
#pragma omp simd
        for (int j = 0; j < len; j++) {
          pf[j] = ff[j];
          pu[j] = uu[j];
        }
        if (col0 + len == width) {
          pf[len] = (T)1;
          pu[len] = (T)1;
        }
        i += len;
      }
      return;
    }
    alignas(64) T f[NB], u[NB], w[NB], a[NB], b[NB], c[NB], d[NB];
    T* outs[7] = {f, u, w, a, b, c, d};
    act_block<T, KIND, false, true, MODE_FULL>(0, k, m + lo, sd, eps, outs);
    alignas(64) T bp[NB], bu[NB], bv[NB];
    load_grad(gp, 0, lo, k, bp);
    load_grad(gu, 0, lo, k, bu);
    load_grad(gv, 0, lo, k, bv);
    const T* RS mm = m + lo;
    T* RS om = o_gm + lo; T* RS ov = o_gv + lo;
#pragma omp simd
    for (int j = 0; j < k; j++) {
      const T fj = f[j];
      variance_gradients<T, KIND>(bp[j] + (T)2 * fj * bu[j], bu[j] + bv[j], fj, mm[j], sd[j], a[j], b[j], c[j], d[j],
                                  om[j], ov[j]);
    }
  });
}

/* ------------------------------------------------ KL of a mean-field Gaussian matrix */

/* KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I)) needs three sums over the matrix: sum
   exp(2 log_scale), sum loc^2 and sum log_scale. One pass, float64 accumulators, fixed
   chunks summed in order (the result does not depend on the thread count). */
static const int64_t KL_CHUNK = 1 << 14;
INLINE float kl_exp(float x) { return expf(x); }
INLINE double kl_exp(double x) { return exp(x); }

template <typename T>
static void diag_kl_sums(int64_t n, const T* loc, const T* ls, double* out, T* var_out, int nthreads) {
  const int64_t nchunks = (n + KL_CHUNK - 1) / KL_CHUNK;
  double* partial = (double*)malloc(sizeof(double) * 3 * (size_t)(nchunks > 0 ? nchunks : 1));
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= 4 * KL_CHUNK)
  for (int64_t c = 0; c < nchunks; c++) {
    const int64_t lo = c * KL_CHUNK, hi = lo + KL_CHUNK < n ? lo + KL_CHUNK : n;
    const T* RS l = loc + lo;
    const T* RS g = ls + lo;
    const int len = (int)(hi - lo);
    double sv = 0.0, sl = 0.0, ss = 0.0;
#pragma omp simd reduction(+ : sv, sl, ss)
    for (int i = 0; i < len; i++) {
      T v = kl_exp((T)2 * g[i]);
      if (var_out) var_out[lo + i] = v;
      sv += (double)v;
      sl += (double)l[i] * (double)l[i];
      ss += (double)g[i];
    }
    partial[3 * c] = sv; partial[3 * c + 1] = sl; partial[3 * c + 2] = ss;
  }
  double a = 0.0, b = 0.0, d = 0.0;
  for (int64_t c = 0; c < nchunks; c++) { a += partial[3 * c]; b += partial[3 * c + 1]; d += partial[3 * c + 2]; }
  free(partial);
  out[0] = a; out[1] = b; out[2] = d;
}

/* A layer's rows of a KL sums table (cfbnn_cli/moments/elbo_reference.py, kl_block_sums): per
   block of `block` elements, in memory order, (sum (Var + loc^2), sum log_scale, count) in
   float64, with Var = exp(2 log_scale) written into var_out and, where given, loc^2 into
   lsq_out. Blocks in parallel, each one's sums in order (no dependence on the thread count). */
template <typename T>
static void diag_kl_table(int64_t n, const T* loc, const T* ls, int64_t block, double* rows, T* var_out, T* lsq_out,
                          int nthreads) {
  const int64_t nblocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN)
  for (int64_t b = 0; b < nblocks; b++) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    const T* RS l = loc + lo;
    const T* RS g = ls + lo;
    T* RS v = var_out + lo;
    const int len = (int)(hi - lo);
    double second = 0.0, log_scales = 0.0;
#pragma omp simd reduction(+ : second, log_scales)
    for (int i = 0; i < len; i++) {
      const T value = kl_exp((T)2 * g[i]);
      v[i] = value;
      second += (double)value + (double)l[i] * (double)l[i];
      log_scales += (double)g[i];
    }
    if (lsq_out) {
      T* RS q = lsq_out + lo;
#pragma omp simd
      for (int i = 0; i < len; i++) q[i] = l[i] * l[i];
    }
    rows[3 * b] = second;
    rows[3 * b + 1] = log_scales;
    rows[3 * b + 2] = (double)len;
  }
}

/* A layer's gradient finished in place, the KL's own gradient folded in: from the matrix
   products' g_loc = dL/d loc / loc_scale and g_var = dL/d Var / scale, with c = dL/dKL / s^2 and
   g = dL/dKL, g_loc <- loc_scale g_loc + c loc and g_var <- Var (scale g_var + c) - g, which is
   dL/d log_scale
   (d Var / d log_scale = 2 Var; dKL/d log_scale = Var / s^2 - 1; dKL/d loc = loc / s^2). */
template <typename T>
static void diag_gradient_finish(int64_t n, const T* loc, const T* var, double loc_scale, double scale,
                                 double kl_scaled, double kl_grad, T* g_loc, T* g_var, int nthreads) {
  const T e = (T)loc_scale, a = (T)scale, c = (T)kl_scaled, b = (T)kl_grad;
#pragma omp parallel for simd schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    g_loc[i] = e * g_loc[i] + c * loc[i];
    g_var[i] = var[i] * (a * g_var[i] + c) - b;
  }
}

/* Its gradient in one pass: d/d loc = scaled loc, d/d log_scale = scaled exp(2 log_scale) - grad
   (scaled = grad / s^2). */
template <typename T>
static void diag_kl_backward(int64_t n, const T* loc, const T* ls, double scaled, double grad, T* g_loc, T* g_ls,
                             int nthreads) {
  const T a = (T)scaled, b = (T)grad;
#pragma omp parallel for simd schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    g_loc[i] = a * loc[i];
    g_ls[i] = a * kl_exp((T)2 * ls[i]) - b;
  }
}

/* [x, 1] and [x^2, 1] of a (rows, D) input in one pass: a first layer's inputs with its bias
   column, for its mean and its variance (bnn/fused/preactivation.py: DiagonalPreactivation). */
template <typename T>
static void augment_pair(int64_t rows, int64_t D, const T* x, T* aug, T* aug_sq, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && rows * D >= PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const T* RS xr = x + r * D;
    T* RS a = aug + r * (D + 1);
    T* RS q = aug_sq + r * (D + 1);
#pragma omp simd
    for (int64_t c = 0; c < D; c++) {
      const T v = xr[c];
      a[c] = v;
      q[c] = v * v;
    }
    a[D] = (T)1;
    q[D] = (T)1;
  }
}

/* ------------------------------------- the Normal likelihood's rows around tail_pass */

/* After tail_pass's forward: with the output bias (mean_bias, spread_bias) the row's residual
   y_r - (mean_r + mean_bias), its squared terms spread_r + spread_bias + residual_r^2 (eq. (7)
   summed over the one output) and ELL_r = -beta/2 squares_r + log_term; returns sum_r ELL_r in
   float64. One loop for what were seven small tensor operations. */
template <typename T>
static double normal_rows(int64_t rows, const T* mean, const T* spread, const T* y, double mean_bias,
                          double spread_bias, double beta, double log_term, T* residual, T* squares, T* ell) {
  const T mb = (T)mean_bias, sb = (T)spread_bias, half_beta = (T)(-0.5 * beta), lt = (T)log_term;
  double total = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    const T res = y[r] - (mean[r] + mb);
    const T sq = (spread[r] + sb) + res * res;
    const T e = sq * half_beta + lt;
    residual[r] = res;
    squares[r] = sq;
    ell[r] = e;
    total += (double)e;
  }
  return total;
}

/* Before tail_pass's backward, from g_r = dL/d ELL_r: u_r = dL/d mean_r = beta g_r residual_r and
   k_r = dL/d squares_r = -beta/2 g_r, and into sums (sum_r u_r, sum_r k_r, sum_r g_r (1/2 - beta/2
   squares_r)): the output bias's two gradients and d/d log beta. */
template <typename T>
static void normal_row_gradients(int64_t rows, const T* grad_ell, const T* residual, const T* squares, double beta,
                                 T* row_u, T* row_k, double* sums) {
  const T b = (T)beta, half_beta = (T)(-0.5 * beta);
  double su = 0.0, sk = 0.0, sl = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    const T g = grad_ell[r];
    const T u = residual[r] * g * b, k = g * half_beta;
    row_u[r] = u;
    row_k[r] = k;
    su += (double)u;
    sk += (double)k;
    sl += (double)g * (0.5 - 0.5 * beta * (double)squares[r]);
  }
  sums[0] = su; sums[1] = sk; sums[2] = sl;
}

/* After tail_pass's backward: the output row's gradients from its column sums cols = [sum_r u_r
   Phi_rc, sum_r k_r Var_rc, sum_r k_r Ups_rc] (float64, 3 x H): d/d loc_c = cols0_c + 2 loc_c
   cols1_c, d/d VarW_c = cols2_c (both times column_scale: the column sums of tail_pass's TAIL_AHEAD
   are taken at a unit upstream gradient), and the bias column's (sum_u, sum_k) when there is one. */
template <typename T>
static void normal_output_gradients(int64_t H, const double* cols, const T* w_phi, int bias, double sum_u,
                                    double sum_k, double column_scale, T* grad_loc, T* grad_var) {
  for (int64_t c = 0; c < H; c++) {
    grad_loc[c] = (T)(column_scale * (cols[c] + 2.0 * (double)w_phi[c] * cols[H + c]));
    grad_var[c] = (T)(column_scale * cols[2 * H + c]);
  }
  if (bias) {
    grad_loc[H] = (T)sum_u;
    grad_var[H] = (T)sum_k;
  }
}

/* ------------------------------------------------- the piecewise-polynomial engine */

/* A piecewise polynomial with B breakpoints, P = B + 1 pieces of degree <= D; K = 2 D.
   Host-side tables (see piecewise_tables.py, coefficient_tables), all float64:
     bp[B]                      breakpoints
     coef[P][D+1]               p_i, ascending powers (zero padded)
     deriv[P][D+1][D+1]         p_i^(k) / k!, ascending powers
     side[P][2]                 p_i at its left (0) and right (1) breakpoint
     tails[P][2][6][K+1]        at that breakpoint, in powers of (z - b): a' (p_i without its
                                constant term), a'a', p_i', a'p_i', p_i'', p_i'^2 + a'p_i''
     jumps[B][4]                p_j(b_j), p_{j+1}(b_j), p_j'(b_j), p_{j+1}'(b_j)
     gl[32]                     16-point Gauss-Legendre nodes, then weights
     coef32[P][D+1], bp32[B]    float32 copies for the std == 0 limit of float32 data
   (piecewise_polynomial.py, PiecewisePolynomial: the same centring, tail differences,
   full-line Taylor expansion and Gauss-Legendre choice, per element.) */
struct Spec {
  int B, D, K, P;
  const double* bp;
  const double* coef;
  const double* deriv;
  const double* side;
  const double* tails;
  const double* jumps;
  const double* gl;
  const float* coef32;
  const float* bp32;
};

enum { V_A1 = 0, V_AA, V_B, V_AB, V_G, V_BBAG, NV };
enum { Q_H = 0, Q_H2, Q_P1, Q_HP1, Q_P2, Q_Q, NQ };  // h, h^2, p', h p', p'', p'^2 + h p''

static const double GL_LIMIT = 4.0;  // piecewise_polynomial._GL_LIMIT
static const double ZEROS[NV * (MAX_K + 1)] = {0};

INLINE double horner1(const double* c, int deg, double x) {
  double r = c[deg];
#pragma GCC unroll 16
  for (int k = deg - 1; k >= 0; k--) r = r * x + c[k];
  return r;
}

/* Per-thread scratch of the engine: rows of NB doubles. */
struct PwScratch {
  double* base;
  double *m, *s, *ssafe, *c, *cd, *cdet, *zero, *Pm, *Ps, *Hm, *Hs;
  double* tot[NQ];
  double* mu[MAX_K + 1];
  double* tj[MAX_B];
  double* pj[MAX_B];
  double* Sj[MAX_B][MAX_K + 1];
  double* cfbuf;  // (K + 1) rows for the continued fraction
  explicit PwScratch(const Spec& sp) {
    int rows = 11 + NQ + 2 * (sp.K + 1) + sp.B * (sp.K + 3);
    base = (double*)aligned_alloc(64, sizeof(double) * (size_t)NB * (size_t)rows);
    double* row = base;
    auto take = [&]() { double* r = row; row += NB; return r; };
    m = take(); s = take(); ssafe = take(); c = take(); cd = take(); cdet = take(); zero = take();
    Pm = take(); Ps = take(); Hm = take(); Hs = take();
    for (int q = 0; q < NQ; q++) tot[q] = take();
    for (int k = 0; k <= sp.K; k++) mu[k] = take();
    cfbuf = row;
    for (int k = 0; k <= sp.K; k++) take();
    for (int j = 0; j < sp.B; j++) {
      tj[j] = take(); pj[j] = take();
      for (int k = 0; k <= sp.K; k++) Sj[j][k] = take();
    }
    for (int e = 0; e < NB; e++) zero[e] = 0.0;
  }
  ~PwScratch() { free(base); }
};

/* E[q (z) 1{far side of breakpoint}] for the six polynomials q, from the small tail S_k
   (sigma = +1: the upper tail, -1: the lower tail), delta = p_i(b) - centre. */
/* Nonzero index range [first, last] of each tail vector of a degree-D piece (structurally:
   a' has powers 1..D, a'a' 2..2D, p' 0..D-1, a'p' 1..2D-1, p'' 0..D-2, p'^2 + a'p'' 0..2D-2). */
INLINE int vec_first(int v) { return v == V_A1 ? 1 : (v == V_AA ? 2 : (v == V_AB ? 1 : 0)); }
INLINE int vec_last(int v, int D) {
  return v == V_A1 ? D : (v == V_AA ? 2 * D : (v == V_B ? D - 1 : (v == V_AB ? 2 * D - 1 : (v == V_G ? D - 2 : 2 * D - 2))));
}

template <int DT, bool GRADS>
INLINE void pw_side(int K, const double* RS tl, const double* const* S, int e, double sigma, double delta,
                    double (&A)[NQ]) {
  constexpr int KC = DT >= 0 ? 2 * DT : MAX_K;
  const int KK = DT >= 0 ? 2 * DT : K;
  const int DD = KK / 2;
  double dots[NV];
#pragma GCC unroll 6
  for (int v = 0; v < (GRADS ? NV : 2); v++) {
    const double* vec = tl + v * (KK + 1);
    const int first = vec_first(v), last = vec_last(v, DD);
    double evn = 0.0, odd = 0.0;
#pragma GCC unroll 40
    for (int k = 0; k <= KC && k <= KK; k++) {
      if (k < first || k > last) continue;  // structurally zero (compile-time for a fixed degree)
      if (k % 2 == 0) evn += vec[k] * S[k][e];
      else odd += vec[k] * S[k][e];
    }
    dots[v] = evn + sigma * odd;
  }
  double S0 = S[0][e];
  A[Q_H] = delta * S0 + dots[V_A1];
  A[Q_H2] = delta * delta * S0 + 2.0 * delta * dots[V_A1] + dots[V_AA];
  if (GRADS) {
    A[Q_P1] = dots[V_B];
    A[Q_HP1] = delta * dots[V_B] + dots[V_AB];
    A[Q_P2] = dots[V_G];
    A[Q_Q] = dots[V_BBAG] + delta * dots[V_G];
  }
}

/* Stage B: every piece, by tail differences, the full line minus tails, or (narrow pieces,
   left to stage C) Gauss-Legendre; accumulated into tot. */
template <int DT, bool GRADS>
static void pw_pieces(const Spec& sp, PwScratch& w) {
  constexpr int DC = DT >= 0 ? DT : MAX_K / 2;
  const int D = DT >= 0 ? DT : sp.D;
  const int K = 2 * D, B = sp.B;
  for (int i = 0; i <= B; i++) {
    const bool has_lo = i > 0, has_hi = i < B;
    // local copies of the constant tables: the compiler then knows the stores below cannot touch them
    constexpr int TC = DT >= 0 ? NV * (2 * DT + 1) : NV * (MAX_K + 1);
    constexpr int DRC = DT >= 0 ? (DT + 1) * (DT + 1) : (MAX_K / 2 + 1) * (MAX_K / 2 + 1);
    double tl_lo[TC], tl_hi[TC], der[DRC];
    {
      const double* src_lo = has_lo ? sp.tails + ((size_t)(i * 2 + 0) * NV) * (K + 1) : ZEROS;
      const double* src_hi = has_hi ? sp.tails + ((size_t)(i * 2 + 1) * NV) * (K + 1) : ZEROS;
      for (int q = 0; q < NV * (K + 1); q++) {
        tl_lo[q] = src_lo[q];
        tl_hi[q] = src_hi[q];
      }
      const double* src_der = sp.deriv + (size_t)i * (D + 1) * (D + 1);
      for (int q = 0; q < (D + 1) * (D + 1); q++) der[q] = src_der[q];
    }
    const double side_lo = has_lo ? sp.side[i * 2 + 0] : 0.0;
    const double side_hi = has_hi ? sp.side[i * 2 + 1] : 0.0;
    const double* t_lo = has_lo ? w.tj[i - 1] : w.zero;
    const double* t_hi = has_hi ? w.tj[i] : w.zero;
    const double* S_lo[MAX_K + 1];
    const double* S_hi[MAX_K + 1];
    const double* mu[MAX_K + 1];
    for (int k = 0; k <= K; k++) {
      S_lo[k] = has_lo ? w.Sj[i - 1][k] : w.zero;
      S_hi[k] = has_hi ? w.Sj[i][k] : w.zero;
      mu[k] = w.mu[k];
    }
    const double* RS m = w.m;
    const double* RS c = w.c;
    double* RS tot0 = w.tot[0];
    double* RS tot1 = w.tot[1];
    double* RS tot2 = w.tot[2];
    double* RS tot3 = w.tot[3];
    double* RS tot4 = w.tot[4];
    double* RS tot5 = w.tot[5];
    double* RS nflag = w.Hs;  // scratch (stage D fills it later)
    int n_narrow = 0;
#pragma omp simd reduction(+ : n_narrow)
    for (int e = 0; e < NB; e++) {
      double me = m[e], ce = c[e];
      double tlo = t_lo[e], thi = t_hi[e];
      // the three cases as 0/1 factors (arithmetic blends: no branches in the vectorized loop)
      const double Rm = (double)(has_lo & (tlo >= 0.0));                 // piece entirely above the mean
      const double Lm = (1.0 - Rm) * (double)(has_hi & (thi <= 0.0));    // entirely below
      const double Sm = 1.0 - Rm - Lm;                                     // contains the mean
      double Alo[NQ] = {0, 0, 0, 0, 0, 0}, Ahi[NQ] = {0, 0, 0, 0, 0, 0};
      pw_side<DT, GRADS>(K, tl_lo, S_lo, e, 2.0 * Rm - 1.0, side_lo - ce, Alo);
      pw_side<DT, GRADS>(K, tl_hi, S_hi, e, 1.0 - 2.0 * Lm, side_hi - ce, Ahi);
      // full line: p_i about the mean, ex_k = p_i^(k)(mean)/k!, h = p_i - centre
      double ex[DC + 3];
#pragma GCC unroll 17
      for (int k = 0; k <= DC && k <= D; k++) {
        const double* cf = der + k * (D + 1);
        double r = cf[D - k];
#pragma GCC unroll 17
        for (int j = D - k - 1; j >= 0; j--) r = r * me + cf[j];
        ex[k] = r;
      }
      ex[0] -= ce;
      double F[NQ] = {0, 0, 0, 0, 0, 0};
#pragma GCC unroll 17
      for (int a = 0; a <= DC && a <= D; a++) {
        if (a % 2 == 0) {
          F[Q_H] += ex[a] * mu[a][e];
          if (GRADS) {
            if (a + 1 <= D) F[Q_P1] += (a + 1) * ex[a + 1] * mu[a][e];
            if (a + 2 <= D) F[Q_P2] += (double)((a + 1) * (a + 2)) * ex[a + 2] * mu[a][e];
          }
        }
#pragma GCC unroll 17
        for (int b = 0; b <= DC && b <= D; b++) {
          if ((a + b) % 2) continue;
          double mab = mu[a + b][e];
          F[Q_H2] += ex[a] * ex[b] * mab;
          if (GRADS) {
            double p1a = a + 1 <= D ? (a + 1) * ex[a + 1] : 0.0;
            double p1b = b + 1 <= D ? (b + 1) * ex[b + 1] : 0.0;
            double p2b = b + 2 <= D ? (double)((b + 1) * (b + 2)) * ex[b + 2] : 0.0;
            F[Q_HP1] += ex[a] * p1b * mab;
            F[Q_Q] += (p1a * p1b + ex[a] * p2b) * mab;
          }
        }
      }
      double width = thi - tlo;
      double reach = 0.5 * (fabs(tlo) + fabs(thi) + fabs(fabs(tlo) - fabs(thi)));  // max(|t_lo|, |t_hi|)
      const double narrow = (double)(has_lo & has_hi & (width * (reach + width) <= GL_LIMIT));  // stage C
      const double keep = 1.0 - narrow;
      nflag[e] = narrow;
      n_narrow += (int)narrow;
      double E[NQ];
#pragma GCC unroll 6
      for (int q = 0; q < NQ; q++) E[q] = keep * ((Rm - Lm) * (Alo[q] - Ahi[q]) + Sm * (F[q] - Alo[q] - Ahi[q]));
      tot0[e] += E[0];
      tot1[e] += E[1];
      if (GRADS) {
        tot2[e] += E[2];
        tot3[e] += E[3];
        tot4[e] += E[4];
        tot5[e] += E[5];
      }
    }
    // stage C: Gauss-Legendre for narrow interior pieces (rare: scalar, on the compacted elements)
    if (!(has_lo && has_hi) || !n_narrow) continue;
    int idx[NB], cnt = 0;
    for (int e = 0; e < NB; e++) {
      idx[cnt] = e;
      cnt += (nflag[e] != 0.0) & (w.s[e] > 0.0);
    }
    const double* ci = sp.coef + (size_t)i * (D + 1);
    const double* c1 = sp.deriv + ((size_t)i * (D + 1) + (D >= 1 ? 1 : 0)) * (D + 1);
    const double* c2 = sp.deriv + ((size_t)i * (D + 1) + (D >= 2 ? 2 : 0)) * (D + 1);
    for (int q = 0; q < cnt; q++) {
      const int e = idx[q];
      double tlo = t_lo[e], thi = t_hi[e];
      double width = thi - tlo;
      double half = 0.5 * width, mid = 0.5 * (thi + tlo);
      double acc[NQ] = {0, 0, 0, 0, 0, 0};
      for (int g = 0; g < 16; g++) {
        double u = mid + half * sp.gl[g];
        double z = w.m[e] + w.s[e] * u;
        double wt = sp.gl[16 + g] * (exp(-0.5 * u * u) * INV_SQRT_2PI);
        double h = horner1(ci, D, z) - w.c[e];
        acc[Q_H] += wt * h;
        acc[Q_H2] += wt * h * h;
        if (GRADS) {
          double p1 = D >= 1 ? horner1(c1, D, z) : 0.0;
          double p2 = D >= 2 ? 2.0 * horner1(c2, D, z) : 0.0;
          acc[Q_P1] += wt * p1;
          acc[Q_HP1] += wt * h * p1;
          acc[Q_P2] += wt * p2;
          acc[Q_Q] += wt * (p1 * p1 + h * p2);
        }
      }
      for (int q = 0; q < (GRADS ? NQ : 2); q++) w.tot[q][e] += half * acc[q];
    }
  }
}

/* Stage A: the small tail at every breakpoint, on the far side from the mean. */
template <int DT>
static void pw_tails(const Spec& sp, PwScratch& w, bool f32) {
  const int D = DT >= 0 ? DT : sp.D;
  const int K = 2 * D;
  for (int j = 0; j < sp.B; j++) {
    const double b = sp.bp[j];
    double* RS t = w.tj[j];
    double* RS pdf = w.pj[j];
    double* S[MAX_K + 1];
    for (int k = 0; k <= K; k++) S[k] = w.Sj[j][k];
    const double* RS mrow = w.m;
    const double* RS srow = w.ssafe;
    alignas(64) double xb[NB];
    // float32 tails (ftail) only for the named activations: a general piecewise polynomial can
    // subtract nearly equal tails (a box much narrower than std but wider than the quadrature
    // limit loses ~2 digits), so the engine keeps the float64 tails of the reference path.
    if (false && f32 && DT >= 0 && DT <= 2) {
      constexpr int KM = DT >= 0 && DT <= 2 ? 2 * DT : 0;
      double* RS S0 = S[0];
      double* RS S1 = KM >= 1 ? S[1] : w.Pm;
      double* RS S2 = KM >= 2 ? S[2] : w.Pm;
      double* RS S3 = KM >= 3 ? S[3] : w.Pm;
      double* RS S4 = KM >= 4 ? S[4] : w.Pm;
      const double xf_clamp = (double)cfbnn_float_clamp;
      const double* RS s_true = w.s;
      int nfix = 0;
#pragma omp simd reduction(+ : nfix)
      for (int e = 0; e < NB; e++) {
        double d = b - mrow[e];
        double se = srow[e];
        double x = distance(fabs(d), se);
        t[e] = d >= 0.0 ? x : -x;
        xb[e] = x;
        nfix += (x >= xf_clamp) & (s_true[e] > 1.0);
        float xf, p, J[KM + 1];
        ftail<KM>(x, xf_clamp, xf, p, J);
        pdf[e] = p;
        double pd = (double)p;
        S0[e] = pd * (double)J[0];
        if (KM >= 1) S1[e] = se * (pd * (double)J[KM >= 1 ? 1 : 0]);
        if (KM >= 2) S2[e] = se * se * (pd * (double)J[KM >= 2 ? 2 : 0]);
        if (KM >= 3) S3[e] = se * se * se * (pd * (double)J[KM >= 3 ? 3 : 0]);
        if (KM >= 4) S4[e] = se * se * se * se * (pd * (double)J[KM >= 4 ? 4 : 0]);
      }
      // beyond XF the float32 tail is 0: with std > 1 it may still matter, take float64 there
      if (!nfix) continue;
      int idx[NB], cnt = 0;
      for (int e = 0; e < NB; e++) {  // branch-free compaction
        idx[cnt] = e;
        cnt += (xb[e] >= xf_clamp) & (w.s[e] > 1.0);
      }
      for (int q = 0; q < cnt; q++) {
        int e = idx[q];
        double Sx[MAX_K + 1];
        pdf[e] = tail_cf(xb[e], w.s[e], K, Sx);
        for (int k = 0; k <= K; k++) S[k][e] = Sx[k];
      }
      continue;
    }
    // float64 tails: erfc and exp, the forward recursion, the continued fraction beyond its limit
    double* RS u1row = K >= 1 ? S[1] : w.Pm;  // scratch when K == 0
    double* RS S0row = S[0];
    const double x_clamp = cfbnn_double_clamp;
#pragma omp simd
    for (int e = 0; e < NB; e++) {
      double d = b - mrow[e];
      double x = distance(fabs(d), srow[e]);
      t[e] = d >= 0.0 ? x : -x;
      xb[e] = x;
      double xc = x < x_clamp ? x : x_clamp;
      double live = x < x_clamp ? 1.0 : 0.0;
      double u0 = live * (0.5 * erfc(xc * INV_SQRT2));
      double p = live * exp(-0.5 * xc * xc + LOG_INV_SQRT_2PI);
      pdf[e] = p;
      S0row[e] = u0;
      u1row[e] = p - xc * u0;
    }
    for (int k = 2; k <= K; k++) {
      const double f = (double)(k - 1);
      double* RS a = S[k - 2];
      double* RS bb = S[k - 1];
      double* RS out = S[k];
#pragma omp simd
      for (int e = 0; e < NB; e++) {
        double xc = xb[e] < x_clamp ? xb[e] : x_clamp;
        out[e] = f * a[e] - xc * bb[e];
      }
    }
    {
      alignas(64) double sk[NB];
      for (int e = 0; e < NB; e++) sk[e] = 1.0;
      for (int k = 1; k <= K; k++) {
        double* RS out = S[k];
#pragma omp simd
        for (int e = 0; e < NB; e++) {
          sk[e] *= srow[e];
          out[e] *= sk[e];
        }
      }
    }
    for_cf_bands(NB, xb, f32 ? recursion_limit_f32(K) : recursion_limit(K), K, [&](int cnt, const int* idx, int depth) {
      alignas(64) double gx[NB], gs[NB], gp[NB];
      double* gS[MAX_K + 1];
      for (int k = 0; k <= K; k++) gS[k] = w.cfbuf + (size_t)k * NB;
      for (int q = 0; q < cnt; q++) {
        gx[q] = xb[idx[q]];
        gs[q] = w.ssafe[idx[q]];
      }
      cf_batch(cnt, K, depth, gx, gs, gS, gp);
      for (int q = 0; q < cnt; q++) {
        pdf[idx[q]] = gp[q];
        for (int k = 0; k <= K; k++) S[k][idx[q]] = gS[k][q];
      }
    }, f32 ? BAND_EXTRA_F32 : BAND_EXTRA);
  }
}

template <typename T, int DT>
static void pw_forward_impl(int64_t n, const T* mean, const T* std_, const Spec& sp, T* o_phi, T* o_ups, T* o_var,
                            T* o_pm, T* o_ps, T* o_vm, T* o_vs, int nthreads) {
  const bool f32 = sizeof(T) == sizeof(float);
  const int D = DT >= 0 ? DT : sp.D;
  const int B = sp.B, K = 2 * D;
  const bool grads = o_pm != nullptr;
  int64_t nblocks = (n + NB - 1) / NB;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN / 4)
  {
    FlushDenormals ftz(f32);
    PwScratch w(sp);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      const int64_t lo = blk * NB;
      const int nreal = (int)(lo + NB < n ? NB : n - lo);
      // the last block is padded (mean 0, std 1): every element takes the same path
      for (int e = 0; e < nreal; e++) {
        w.m[e] = (double)mean[lo + e];
        w.s[e] = (double)std_[lo + e];
      }
      for (int e = nreal; e < NB; e++) {
        w.m[e] = 0.0;
        w.s[e] = 1.0;
      }
      int zeros = 0;
#pragma omp simd reduction(+ : zeros)
      for (int e = 0; e < NB; e++) {
        zeros += !(w.s[e] > 0.0);
        w.ssafe[e] = w.s[e] > 0.0 ? w.s[e] : 1.0;
      }
      // centre c = g(mean) (the piece polynomial, evaluated as torch does) and g'(mean)
      {
        const double* c0 = sp.coef;
        const double* d0 = sp.deriv + (D >= 1 ? 1 : 0) * (D + 1);
        double* RS cr = w.c;
        double* RS cdr = w.cd;
        const double* RS mr = w.m;
#pragma omp simd
        for (int e = 0; e < NB; e++) {
          cr[e] = horner1(c0, D, mr[e]);
          cdr[e] = D >= 1 ? horner1(d0, D, mr[e]) : 0.0;
        }
        for (int j = 0; j < B; j++) {
          // local copies of the constants (so that the stores below cannot alias them)
          double cj[MAX_K / 2 + 1], dj[MAX_K / 2 + 1];
          for (int k = 0; k <= D; k++) {
            cj[k] = sp.coef[(size_t)(j + 1) * (D + 1) + k];
            dj[k] = sp.deriv[((size_t)(j + 1) * (D + 1) + (D >= 1 ? 1 : 0)) * (D + 1) + k];
          }
          const double b = sp.bp[j];
#pragma omp simd
          for (int e = 0; e < NB; e++) {
            bool right = mr[e] >= b;
            double cv = horner1(cj, D, mr[e]), dv = D >= 1 ? horner1(dj, D, mr[e]) : 0.0;
            cr[e] = right ? cv : cr[e];
            cdr[e] = right ? dv : cdr[e];
          }
        }
      }
      // the std == 0 limit: g(mean); for float32 data the float32 evaluation (== torch's)
      for (int e = 0; e < NB; e++) w.cdet[e] = w.c[e];
      if (f32 && zeros) {
        for (int e = 0; e < NB; e++) {
          if (w.s[e] > 0.0) continue;
          float x = (float)w.m[e];
          int piece = 0;
          for (int j = 0; j < B; j++) piece = x >= sp.bp32[j] ? j + 1 : piece;
          const float* cc = sp.coef32 + piece * (D + 1);
          float r = cc[D];
          for (int k = D - 1; k >= 0; k--) r = r * x + cc[k];
          w.cdet[e] = (double)r;
        }
      }
      // mu_k = E[(z - mean)^k] = std^k (k-1)!! (even k)
      for (int e = 0; e < NB; e++) w.mu[0][e] = 1.0;
      for (int k = 1; k <= K; k++) {
        if (k % 2) {
          for (int e = 0; e < NB; e++) w.mu[k][e] = 0.0;
        } else {
          const double f = (double)(k - 1);
          for (int e = 0; e < NB; e++) w.mu[k][e] = w.mu[k - 2][e] * w.ssafe[e] * w.ssafe[e] * f;
        }
      }
      pw_tails<DT>(sp, w, f32);
      for (int q = 0; q < NQ; q++)
        for (int e = 0; e < NB; e++) w.tot[q][e] = 0.0;
      if (grads) pw_pieces<DT, true>(sp, w);
      else pw_pieces<DT, false>(sp, w);
      // stage D: density terms of the kinks (gradients), then the outputs
      if (grads) {
        // 1/std in the cdet row while the density terms are summed (cdet is restored below)
        alignas(64) double cdet_keep[NB];
        memcpy(cdet_keep, w.cdet, sizeof(cdet_keep));
        for (int e = 0; e < NB; e++) w.cdet[e] = 1.0 / w.ssafe[e];
#pragma omp simd
        for (int e = 0; e < NB; e++) {
          w.Pm[e] = w.tot[Q_P1][e];
          w.Ps[e] = w.ssafe[e] * w.tot[Q_P2][e];
          w.Hm[e] = 2.0 * w.tot[Q_HP1][e];
          w.Hs[e] = 2.0 * w.ssafe[e] * w.tot[Q_Q][e];
        }
        for (int j = 0; j < B; j++) {
          // p_j(b), p_{j+1}(b), p_j'(b), p_{j+1}'(b), as locals
          const double J0 = sp.jumps[4 * j], J1 = sp.jumps[4 * j + 1], J2 = sp.jumps[4 * j + 2], J3 = sp.jumps[4 * j + 3];
          const double dV = J1 - J0, dD = J3 - J2;
          const double* RS pr = w.pj[j];
          const double* RS tr = w.tj[j];
          const double* RS sr = w.cdet;  // holds 1/std here (see below)
          const double* RS cr = w.c;
          double* RS Pm = w.Pm;
          double* RS Ps = w.Ps;
          double* RS Hm = w.Hm;
          double* RS Hs = w.Hs;
#pragma omp simd
          for (int e = 0; e < NB; e++) {
            double p = pr[e], t = tr[e], cc = cr[e];
            double dens = p * sr[e], slope = dens * t;  // E[delta(z-b)], std E[delta'(z-b)]
            double hm = J0 - cc, hp = J1 - cc;
            double dh2 = dV * (hp + hm);                // jump of h^2
            double d2hp = 2.0 * (hp * J3 - hm * J2);    // jump of (h^2)' = 2 h p'
            Pm[e] += dV * dens;
            Ps[e] += dD * p + dV * slope;
            Hm[e] += dh2 * dens;
            Hs[e] += d2hp * p + dh2 * slope;
          }
        }
        memcpy(w.cdet, cdet_keep, sizeof(cdet_keep));
      }
#pragma omp simd
      for (int e = 0; e < nreal; e++) {
        int64_t o = lo + e;
        double F1 = w.tot[Q_H][e], F2 = w.tot[Q_H2][e];
        bool pos = w.s[e] > 0.0;
        double phi = pos ? w.c[e] + F1 : w.cdet[e];
        double var_raw = pos ? F2 - F1 * F1 : 0.0;
        double v = var_raw > 0.0 ? var_raw : 0.0;
        T pf = (T)phi, vf = (T)v;
        o_phi[o] = pf;
        o_ups[o] = (T)((double)vf + (double)pf * (double)pf);
        if (o_var) o_var[o] = vf;
        if (grads) {
          double keep = (pos && var_raw >= 0.0) ? 1.0 : 0.0;
          o_pm[o] = (T)(pos ? w.Pm[e] : w.cd[e]);  // std == 0: only the centre moves
          o_ps[o] = (T)(pos ? w.Ps[e] : 0.0);
          o_vm[o] = (T)(keep * (w.Hm[e] - 2.0 * F1 * w.Pm[e]));
          o_vs[o] = (T)(keep * (w.Hs[e] - 2.0 * F1 * w.Ps[e]));
        }
      }
    }
  }
}

template <typename T>
static void pw_forward(int64_t n, const T* m, const T* s, const Spec& sp, T* phi, T* ups, T* var,
                       T* pm, T* ps, T* vm, T* vs, int nt) {
  switch (sp.D) {
    case 0: pw_forward_impl<T, 0>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt); break;
    case 1: pw_forward_impl<T, 1>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt); break;
    case 2: pw_forward_impl<T, 2>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt); break;
    case 3: pw_forward_impl<T, 3>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt); break;
    default: pw_forward_impl<T, -1>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt); break;
  }
}

/* ------------------------------------------------ hard sigmoid, float32: the engine, unrolled */

/* g = sign clamp(z, -a, a), a > 0: the engine's sums for B = 2, D = 1 written out. With the small
   tails S_k^0 at -a and S_k^1 at +a (each on the far side from the mean) and c = clamp(mean):
     E[g - c]      = S_1^0 - S_1^1                                  (every position of the mean)
     E[(g - c)^2]  = std^2 - S_2^0 - 2 d_0 S_1^0 - S_2^1 - 2 d_1 S_1^1   (-a <= mean < a; d_0 = mean + a,
                                                                         d_1 = a - mean)
                   = S_2^1 - S_2^0 - 4 a S_1^0                      (mean >= a)
                   = S_2^0 - S_2^1 - 4 a S_1^1                      (mean < -a)
   and the heat-equation partials: dPhi/dmean = P(-a < z < a), dPhi/dstd = phi(t_0) - phi(t_1),
   dE[(g-c)^2]/dmean = 2 E[(g - c) 1{-a<z<a}], dE[(g-c)^2]/dstd = 2 std P(-a<z<a)
   + 2 (-a - c) phi(t_0) - 2 (a - c) phi(t_1). Elements where the engine would use
   Gauss-Legendre (the middle piece narrow) or where a float32 tail beyond 13 sigma could still
   be a normal result (std > 1) are handed to the general engine. */
__attribute__((noinline))  // keeps its loop a vectorization unit of its own
static int hs_f32_range(int64_t lo, int64_t hi, const float* RS m, const float* RS s, float a, float sg, bool var_out,
                        bool grads, float* RS o_phi, float* RS o_ups, float* RS o_var, float* RS o_pm, float* RS o_ps,
                        float* RS o_vm, float* RS o_vs, unsigned char* RS engine) {
  const float xf_clamp = cfbnn_float_clamp;
  int hand_over = 0;
#pragma omp simd reduction(+ : hand_over)
  for (int64_t i = lo; i < hi; i++) {
    const float mi = m[i], si = s[i];
    const float d0 = mi + a, d1 = a - mi;  // exact for representable a (Sterbenz near the kinks)
    float x0r, dx0, x1r, dx1;
    fdistance(fabsf(d0), si, x0r, dx0);
    fdistance(fabsf(d1), si, x1r, dx1);
    float x0, p0, J0[3], x1, p1, J1[3];
    ftail_x<2>(x0r, dx0, xf_clamp, x0, p0, J0);
    ftail_x<2>(x1r, dx1, xf_clamp, x1, p1, J1);
    const float sp0 = si * p0, sp1 = si * p1;
    const float S00 = p0 * J0[0], S10 = sp0 * J0[1], S20 = (si * sp0) * J0[2];
    const float S01 = p1 * J1[0], S11 = sp1 * J1[1], S21 = (si * sp1) * J1[2];
    const bool B = mi >= a, C = mi < -a, A = !(B | C);
    const float c = A ? mi : (B ? a : -a);
    const float F1 = S10 - S11;
    const float F2A = si * si - S20 - 2.0f * d0 * S10 - S21 - 2.0f * d1 * S11;
    const float F2B = S21 - S20 - 4.0f * a * S10;
    const float F2C = S20 - S21 - 4.0f * a * S11;
    const float F2 = A ? F2A : (B ? F2B : F2C);
    const bool pos = si > 0.0f;
    const float phi = sg * (pos ? c + F1 : c);
    const float var_raw = pos ? F2 - F1 * F1 : 0.0f;
    const float v = var_raw > 0.0f ? var_raw : 0.0f;
    o_phi[i] = phi;
    o_ups[i] = fmaf(phi, phi, v);
    if (var_out) o_var[i] = v;
    if (grads) {
      const float Pmid = A ? 1.0f - S00 - S01 : (B ? S01 - S00 : S00 - S01);
      const float Ps = p0 - p1;
      const float EhA = S10 + d0 * S00 - S11 - d1 * S01;
      const float EhB = S10 - S11 + 2.0f * a * S00;
      const float EhC = S10 - S11 - 2.0f * a * S01;
      const float Hm = 2.0f * (A ? EhA : (B ? EhB : EhC));
      const float Hs = 2.0f * si * Pmid + 2.0f * (-a - c) * p0 - 2.0f * (a - c) * p1;
      const float keep = (pos & (var_raw >= 0.0f)) ? 1.0f : 0.0f;
      o_pm[i] = sg * (pos ? Pmid : (A ? 1.0f : 0.0f));  // std == 0: g'(mean)
      o_ps[i] = pos ? sg * Ps : 0.0f;
      o_vm[i] = keep * (Hm - 2.0f * F1 * Pmid);
      o_vs[i] = keep * (Hs - 2.0f * F1 * Ps);
    }
    const float width = 2.0f * a / (si > FTINY ? si : FTINY);
    const float reach = x0r > x1r ? x0r : x1r;
    const bool narrow = width * (reach + width) <= 4.0f;  // piecewise_polynomial._GL_LIMIT
    const bool far = (si > 1.0f) & ((B & (x1r >= xf_clamp)) | (C & (x0r >= xf_clamp)));
    // a variance within ~1e10 of FLT_MIN is a difference of tails some of which fell below the
    // normal range (flushed): float64 tails there
    // 0 < var_raw < limit, written as one comparison (a second boolean & stops gcc 12 from
    // vectorizing this loop). An exact 0 is a sum of tails all below FLT_MIN: so is the variance.
    // (scaled by 1e30 so that the product cannot underflow)
    const float vsc = var_raw * 1e30f, vlim = 100.0f * (si > 1.0f ? si * si : 1.0f);
    const bool tiny = vsc * (vsc - vlim) < 0.0f;
    const bool hand = pos & (narrow | far | tiny);
    engine[i - lo] = hand;
    hand_over += hand;
  }
  return hand_over;
}

template <typename T>
static void pw_forward(int64_t n, const T* m, const T* s, const Spec& sp, T* phi, T* ups, T* var,
                       T* pm, T* ps, T* vm, T* vs, int nt);

/* The hard sigmoid over [lo, hi) of (m, s) into outs (phi, ups, var, dPhi/dmean, dPhi/dstd,
   dVar/dmean, dVar/dstd; null entries skipped), element i of the range at outs[j][i - lo + out_off].
   The elements the unrolled kernel hands over are collected and given to the general engine in
   one call at the end (its per-call set-up is not paid per block). */
static void hs_range(int64_t lo, int64_t hi, const float* m, const float* s, const Spec& sp, float a, float sg,
                     float* const* outs, int64_t out_off) {
  const bool grads = outs[3] != nullptr;
  int64_t cap = 0, count = 0;
  int64_t* pending = nullptr;
  for (int64_t b0 = lo; b0 < hi; b0 += NB) {
    const int64_t b1 = b0 + NB < hi ? b0 + NB : hi;
    float* dst[7];
    for (int j = 0; j < 7; j++) dst[j] = outs[j] ? outs[j] + (out_off - lo) : nullptr;  // indexed by element
    PaddedBlock<float, 7> pad(b0, b1, m, s, {dst[0], dst[1], dst[2], dst[3], dst[4], dst[5], dst[6]});
    float** o = pad.outputs;
    unsigned char engine[NB];
    int cnt = hs_f32_range(pad.lo, pad.hi, pad.m, pad.s, a, sg, o[2] != nullptr, grads, o[0], o[1], o[2], o[3], o[4],
                           o[5], o[6], engine);
    pad.finish();
    if (cnt) {
      if (count + cnt > cap) {
        cap = 2 * (count + cnt) + 64;
        pending = (int64_t*)realloc(pending, sizeof(int64_t) * (size_t)cap);
      }
      const int nb = (int)(b1 - b0);
      for (int e = 0; e < nb; e++) {
        pending[count] = b0 + e;
        count += engine[e];
      }
    }
  }
  if (!count) return;
  float* buf = (float*)malloc(sizeof(float) * (size_t)count * 9);
  float* gm_ = buf;
  float* gs_ = buf + count;
  float* r[7];
  for (int j = 0; j < 7; j++) r[j] = buf + (2 + j) * count;
  for (int64_t q = 0; q < count; q++) {
    gm_[q] = m[pending[q]];
    gs_[q] = s[pending[q]];
  }
  pw_forward<float>(count, gm_, gs_, sp, r[0], r[1], outs[2] ? r[2] : nullptr, grads ? r[3] : nullptr,
                    grads ? r[4] : nullptr, grads ? r[5] : nullptr, grads ? r[6] : nullptr, 1);
  for (int64_t q = 0; q < count; q++)
    for (int j = 0; j < 7; j++)
      if (outs[j]) outs[j][pending[q] - lo + out_off] = r[j][q];
  free(buf);
  free(pending);
}

/* f(lo, hi) in each thread of a team, [lo, hi) the thread's contiguous share of whole blocks of NB
   of [0, n) (as schedule(static); one thread below PAR_MIN elements), float denormals flushed. */
template <typename F>
INLINE void for_each_share(int64_t n, int nthreads, F f) {
  const int nt = (nthreads > 1 && n >= PAR_MIN) ? nthreads : 1;
  const int64_t nblocks = (n + NB - 1) / NB;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    FlushDenormals ftz(true);
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int tid = 0, team = 1;
#endif
    const int64_t first = nblocks * tid / team, last = nblocks * (tid + 1) / team;
    f(first * NB, last * NB < n ? last * NB : n);
  }
}

static void hs_forward_f32(int64_t n, const float* m, const float* s, const Spec& sp, float a, float sg, float* phi,
                           float* ups, float* var, float* pm, float* ps, float* vm, float* vs, int nthreads) {
  float* outs[7] = {phi, ups, var, pm, ps, vm, vs};
  for_each_share(n, nthreads, [&](int64_t lo, int64_t hi) {
    if (lo < hi) hs_range(lo, hi, m, s, sp, a, sg, outs, lo);
  });
}

/* Backward: the partials recomputed chunk by chunk (no saved buffers), then combined with the
   gradients; chunks of CHUNK elements amortize the engine call for handed-over elements. */
static void hs_backward_f32(int64_t n, const float* m, const float* s, const Spec& sp, float a, float sg,
                            const float* phi, const float* gp, int gp_scalar, const float* gu, int gu_scalar,
                            const float* gv, int gv_scalar, float* o_gm, float* o_gs, int nthreads) {
  const int64_t CHUNK = 64 * NB;
  for_each_share(n, nthreads, [&](int64_t lo, int64_t hi) {
    float* buf = (float*)aligned_alloc(64, sizeof(float) * (size_t)CHUNK * 8);
    float* f0 = buf; float* f1 = buf + CHUNK; float* pm = buf + 2 * CHUNK; float* ps = buf + 3 * CHUNK;
    float* vm = buf + 4 * CHUNK; float* vs = buf + 5 * CHUNK;
    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
      const int64_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
      float* outs[7] = {f0, f1, nullptr, pm, ps, vm, vs};
      hs_range(c0, c1, m, s, sp, a, sg, outs, 0);
      for (int64_t b0 = c0; b0 < c1; b0 += NB) {
        const int k = (int)(b0 + NB < c1 ? NB : c1 - b0);
        const int64_t at = b0 - c0;  // the block's place in the chunk's partials
        partials_block<float>(b0, k, phi + b0, pm + at, ps + at, vm + at, vs + at, gp, gp_scalar, gu, gu_scalar, gv,
                              gv_scalar, o_gm + b0, o_gs + b0);
      }
    }
    free(buf);
  });
}

/* ---------------------------------------------------------------- the ReLU family's kinds */

/* body(k) with k a compile-time kind of the ReLU family (decltype(k)::value its number, as in
   cfbnn_cli/moments/relu_family.py: ACTIVATION_KINDS): 0 ReLU, 1 leaky ReLU, 2 ReLU^2. The one list of the kinds in
   C++: a new member is one more case here, and its moments where act_f32_range, act_f64_range,
   store_outputs and variance_gradients branch on the kind. The operators check the kind first (family_size). */
static_assert(cfbnn::kernels::FAMILY_SIZE == 3, "by_kind has one case per member");
template <typename F>
INLINE void by_kind(int kind, F&& body) {
  switch (kind) {
    case 0: body(std::integral_constant<int, 0>{}); break;
    case 1: body(std::integral_constant<int, 1>{}); break;
    default: body(std::integral_constant<int, 2>{}); break;
  }
}

/* A member's backward: from the four partials its forward computes (act_backward); ReLU's from
   its own Gaussian factors (relu_backward), the overload taken for kind 0. */
template <typename T, int KIND>
static void family_backward(std::integral_constant<int, KIND>, int64_t n, const T* m, const T* s, double eps,
                            const T* phi, const T* gp, int gps, const T* gu, int gus, const T* gv, int gvs, T* gm,
                            T* gs, int nt) {
  act_backward<T, KIND>(n, m, s, eps, phi, gp, gps, gu, gus, gv, gvs, gm, gs, nt);
}
template <typename T>
static void family_backward(std::integral_constant<int, 0>, int64_t n, const T* m, const T* s, double, const T* phi,
                            const T* gp, int gps, const T* gu, int gus, const T* gv, int gvs, T* gm, T* gs, int nt) {
  relu_backward<T>(n, m, s, phi, gp, gps, gu, gus, gv, gvs, gm, gs, nt);
}

/* ---------------------------------------------------------------- the kernels of kernels.h */

namespace cfbnn {
namespace kernels {

#define BOTH(MACRO) MACRO(float, f32) MACRO(double, f64)

#define ACT_ENTRIES(T, SUF)                                                                                      \
  void family_forward_##SUF(int kind, int64_t n, const T* m, const T* s, double eps, T* phi, T* ups,  \
                                       T* var, int nt) {                                                         \
    by_kind(kind, [&](auto k) {                                                                                  \
      act_forward<T, decltype(k)::value>(n, m, s, eps, phi, ups, var, nullptr, nullptr, nullptr, nullptr, nt, false);           \
    });                                                                                                          \
  }                                                                                                              \
  void relu_mean_##SUF(int64_t n, const T* m, const T* s, T* phi, int nt) {                          \
    act_forward<T, 0>(n, m, s, 0.0, phi, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nt, true);        \
  }                                                                                                              \
  void family_backward_##SUF(int kind, int64_t n, const T* m, const T* s, double eps, const T* phi,   \
                                        const T* gp, int gps, const T* gu, int gus, const T* gv, int gvs, T* gm, \
                                        T* gs, int nt) {                                                         \
    by_kind(kind, [&](auto k) { family_backward<T>(k, n, m, s, eps, phi, gp, gps, gu, gus, gv, gvs, gm, gs, nt); }); \
  }                                                                                                              \
  void partials_backward_##SUF(int64_t n, const T* phi, const T* pm, const T* ps, const T* vm,       \
                                          const T* vs, const T* gp, int gps, const T* gu, int gus, const T* gv,  \
                                          int gvs, T* gm, T* gs, int nt) {                                       \
    partials_backward<T>(n, phi, pm, ps, vm, vs, gp, gps, gu, gus, gv, gvs, gm, gs, nt);                          \
  }                                                                                                              \
  int64_t count_negative_##SUF(int64_t n, const T* s, int nt) { return count_negative<T>(n, s, nt); } \
  void tail_pass_##SUF(int kind, int mode, int64_t rows, int64_t H, const T* m, const T* s,         \
                                  double eps, const T* wp, const T* wv, const T* wu, const T* ru, const T* rk,   \
                                  const T* y, double mb, double uu, double ku, T* om, T* osp, T* ogm, T* ogs,    \
                                  double* ocols, int nt) {                                                       \
    by_kind(kind, [&](auto k) {                                                                                  \
      tail_pass<T, decltype(k)::value>(mode, rows, H, m, s, eps, wp, wv, wu, ru, rk, y, mb, uu, ku, om, osp, ogm, ogs, ocols, nt); \
    });                                                                                                          \
  }                                                                                                              \
  void hidden_pass_##SUF(int kind, int backward, int64_t n, const T* m, const T* v, double eps,       \
                                    T* op, T* ou, T* ov, const T* gp, const T* gu, const T* gv, T* ogm, T* ogv,   \
                                    int64_t w, int nt) {                                                         \
    by_kind(kind, [&](auto k) {                                                                                  \
      hidden_pass<T, decltype(k)::value>(backward, n, m, v, eps, op, ou, ov, gp, gu, gv, ogm, ogv, w, nt);                      \
    });                                                                                                          \
  }                                                                                                              \
  void diag_kl_sums_##SUF(int64_t n, const T* loc, const T* ls, double* out, T* var, int nt) {       \
    diag_kl_sums<T>(n, loc, ls, out, var, nt);                                                                   \
  }                                                                                                              \
  void diag_kl_table_##SUF(int64_t n, const T* loc, const T* ls, int64_t block, double* rows, T* var, \
                                      T* lsq, int nt) {                                                          \
    diag_kl_table<T>(n, loc, ls, block, rows, var, lsq, nt);                                                     \
  }                                                                                                              \
  void diag_gradient_finish_##SUF(int64_t n, const T* loc, const T* var, double e, double a, double c, \
                                             double b, T* gl, T* gv, int nt) {                                   \
    diag_gradient_finish<T>(n, loc, var, e, a, c, b, gl, gv, nt);                                                \
  }                                                                                                              \
  void diag_kl_backward_##SUF(int64_t n, const T* loc, const T* ls, double a, double b, T* gl,       \
                                         T* gs, int nt) {                                                        \
    diag_kl_backward<T>(n, loc, ls, a, b, gl, gs, nt);                                                           \
  }                                                                                                              \
  void pw_forward_##SUF(int64_t n, const T* m, const T* s, int B, int D, const double* bp,           \
                                   const double* coef, const double* deriv, const double* side,                  \
                                   const double* tails, const double* jumps, const double* gl,                   \
                                   const float* coef32, const float* bp32, T* phi, T* ups, T* var, T* pm, T* ps, \
                                   T* vm, T* vs, int nt) {                                                       \
    Spec sp;                                                                                                     \
    sp.B = B; sp.D = D; sp.K = 2 * D; sp.P = B + 1;                                                              \
    sp.bp = bp; sp.coef = coef; sp.deriv = deriv; sp.side = side; sp.tails = tails; sp.jumps = jumps;            \
    sp.gl = gl; sp.coef32 = coef32; sp.bp32 = bp32;                                                              \
    pw_forward<T>(n, m, s, sp, phi, ups, var, pm, ps, vm, vs, nt);                                               \
    propagate_nan_all<T>(n, m, s, {phi, ups, var, pm, ps, vm, vs});                                              \
  }

BOTH(ACT_ENTRIES)

#define NORMAL_ROW_ENTRIES(T, SUF)                                                                               \
  void augment_pair_##SUF(int64_t rows, int64_t D, const T* x, T* aug, T* sq, int nt) {              \
    augment_pair<T>(rows, D, x, aug, sq, nt);                                                                    \
  }                                                                                                              \
  double normal_rows_##SUF(int64_t rows, const T* mean, const T* spread, const T* y, double mb,      \
                                      double sb, double beta, double lt, T* res, T* sq, T* ell) {               \
    return normal_rows<T>(rows, mean, spread, y, mb, sb, beta, lt, res, sq, ell);                                \
  }                                                                                                              \
  void normal_row_gradients_##SUF(int64_t rows, const T* g, const T* res, const T* sq, double beta,   \
                                             T* u, T* k, double* sums) {                                         \
    normal_row_gradients<T>(rows, g, res, sq, beta, u, k, sums);                                                 \
  }                                                                                                              \
  void normal_output_gradients_##SUF(int64_t H, const double* cols, const T* wp, int bias, double su,  \
                                                double sk, double cs, T* gl, T* gv) {                            \
    normal_output_gradients<T>(H, cols, wp, bias, su, sk, cs, gl, gv);                                          \
  }

BOTH(NORMAL_ROW_ENTRIES)

void hs_forward_f32(int64_t n, const float* m, const float* s, int B, int D, const double* bp,
                               const double* coef, const double* deriv, const double* side, const double* tails,
                               const double* jumps, const double* gl, const float* coef32, const float* bp32, double a,
                               double sign, float* phi, float* ups, float* var, float* pm, float* ps, float* vm,
                               float* vs, int nt) {
  Spec sp;
  sp.B = B; sp.D = D; sp.K = 2 * D; sp.P = B + 1;
  sp.bp = bp; sp.coef = coef; sp.deriv = deriv; sp.side = side; sp.tails = tails; sp.jumps = jumps;
  sp.gl = gl; sp.coef32 = coef32; sp.bp32 = bp32;
  ::hs_forward_f32(n, m, s, sp, (float)a, (float)sign, phi, ups, var, pm, ps, vm, vs, nt);
  propagate_nan_all<float>(n, m, s, {phi, ups, var, pm, ps, vm, vs});
}

void hs_backward_f32(int64_t n, const float* m, const float* s, int B, int D, const double* bp,
                                const double* coef, const double* deriv, const double* side, const double* tails,
                                const double* jumps, const double* gl, const float* coef32, const float* bp32,
                                double a, double sign, const float* phi, const float* gp, int gps, const float* gu,
                                int gus, const float* gv, int gvs, float* gm, float* gs, int nt) {
  Spec sp;
  sp.B = B; sp.D = D; sp.K = 2 * D; sp.P = B + 1;
  sp.bp = bp; sp.coef = coef; sp.deriv = deriv; sp.side = side; sp.tails = tails; sp.jumps = jumps;
  sp.gl = gl; sp.coef32 = coef32; sp.bp32 = bp32;
  ::hs_backward_f32(n, m, s, sp, (float)a, (float)sign, phi, gp, gps, gu, gus, gv, gvs, gm, gs, nt);
  propagate_nan_all<float>(n, m, s, {gm, gs});
}

static_assert(MAX_BREAKPOINTS == MAX_B && MAX_DEGREE == MAX_K / 2, "kernels.h: the engine's table sizes");

}  // namespace kernels
}  // namespace cfbnn
