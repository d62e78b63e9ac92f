/* The kernels of kernels.cpp that the operators' units (family_ops.cpp, piecewise_ops.cpp, elbo_ops.cpp)
 * call, declared once.
 *
 * kernels.cpp includes this header too, so a definition whose signature drifts from its declaration
 * here fails to compile instead of corrupting memory at run time. Each kernel exists for float32
 * (_f32) and float64 (_f64) arrays; every pointer is a contiguous array; `nt` is the thread count. */
#ifndef CFBNN_KERNELS_H
#define CFBNN_KERNELS_H

#include <stdint.h>

namespace cfbnn {
namespace kernels {

/* The ReLU family's members, kinds 0 .. FAMILY_SIZE - 1 (cfbnn_cli/moments/relu_family.py: ACTIVATION_KINDS). */
constexpr int FAMILY_SIZE = 3;
/* The general piecewise engine's largest tables. */
constexpr int MAX_BREAKPOINTS = 64, MAX_DEGREE = 16;

#define CFBNN_KERNEL_DECLARATIONS(T, SUF)                                                                        \
  void family_forward_##SUF(int kind, int64_t n, const T* m, const T* s, double eps, T* phi, T* ups, T* var,  \
                             int nt);                                                                            \
  void relu_mean_##SUF(int64_t n, const T* m, const T* s, T* phi, int nt);                                       \
  int64_t count_negative_##SUF(int64_t n, const T* s, int nt);                                                   \
  void family_backward_##SUF(int kind, int64_t n, const T* m, const T* s, double eps, const T* phi, const T* gp, \
                              int gps, const T* gu, int gus, const T* gv, int gvs, T* gm, T* gs, int nt);        \
  void hidden_pass_##SUF(int kind, int backward, int64_t n, const T* m, const T* v, double eps, T* op, T* ou,     \
                         T* ov, const T* gp, const T* gu, const T* gv, T* ogm, T* ogv, int64_t w, int nt);        \
  void diag_kl_backward_##SUF(int64_t n, const T* loc, const T* ls, double a, double b, T* gl, T* gs, int nt);   \
  void augment_pair_##SUF(int64_t rows, int64_t D, const T* x, T* aug, T* sq, int nt);                         \
  void diag_kl_sums_##SUF(int64_t n, const T* loc, const T* ls, double* out, T* var, int nt);                  \
  void diag_kl_table_##SUF(int64_t n, const T* loc, const T* ls, int64_t block, double* rows, T* var, T* lsq,   \
                           int nt);                                                                            \
  void diag_gradient_finish_##SUF(int64_t n, const T* loc, const T* var, double e, double a, double c,        \
                                  double b, T* gl, T* gv, int nt);                                             \
  double normal_rows_##SUF(int64_t rows, const T* mean, const T* spread, const T* y, double mb, double sb,     \
                           double beta, double lt, T* res, T* sq, T* ell);                                     \
  void normal_row_gradients_##SUF(int64_t rows, const T* g, const T* res, const T* sq, double beta, T* u, T* k, \
                                  double* sums);                                                               \
  void normal_output_gradients_##SUF(int64_t H, const double* cols, const T* wp, int bias, double su,          \
                                     double sk, double cs, T* gl, T* gv);                                      \
  void tail_pass_##SUF(int kind, int mode, int64_t rows, int64_t H, const T* m, const T* s, double eps,       \
                       const T* wp, const T* wv, const T* wu, const T* ru, const T* rk, const T* y, double mb,   \
                       double uu, double ku, T* om, T* osp, T* ogm, T* ogs, double* ocols, int nt);             \
  void pw_forward_##SUF(int64_t n, const T* m, const T* s, int B, int D, const double* bp, const double* coef,   \
                        const double* deriv, const double* side, const double* tails, const double* jumps,      \
                        const double* gl, const float* coef32, const float* bp32, T* phi, T* ups, T* var,       \
                        T* pm, T* ps, T* vm, T* vs, int nt);                                                    \
  void partials_backward_##SUF(int64_t n, const T* phi, const T* pm, const T* ps, const T* vm, const T* vs,     \
                               const T* gp, int gps, const T* gu, int gus, const T* gv, int gvs, T* gm, T* gs,  \
                               int nt);

CFBNN_KERNEL_DECLARATIONS(float, f32)
CFBNN_KERNEL_DECLARATIONS(double, f64)

#undef CFBNN_KERNEL_DECLARATIONS

/* The hard sigmoid's unrolled float32 kernels (the general engine's tables, a = |alpha|, sign). */
void hs_forward_f32(int64_t n, const float* m, const float* s, int B, int D, const double* bp, const double* coef,
                    const double* deriv, const double* side, const double* tails, const double* jumps,
                    const double* gl, const float* coef32, const float* bp32, double a, double sign, float* phi,
                    float* ups, float* var, float* pm, float* ps, float* vm, float* vs, int nt);
void hs_backward_f32(int64_t n, const float* m, const float* s, int B, int D, const double* bp, const double* coef,
                     const double* deriv, const double* side, const double* tails, const double* jumps,
                     const double* gl, const float* coef32, const float* bp32, double a, double sign,
                     const float* phi, const float* gp, int gps, const float* gu, int gus, const float* gv, int gvs,
                     float* gm, float* gs, int nt);

}  // namespace kernels
}  // namespace cfbnn

#endif
