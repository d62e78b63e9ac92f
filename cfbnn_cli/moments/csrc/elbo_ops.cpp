/* The closed-form ELBO's operators' CPU kernels (cfbnn_cli/moments/elbo_ops.py declares the operators,
 * their reference kernels, Triton kernels, fakes and vmap rules): a mean-field matrix's KL and its
 * gradients, the ELBO's forward and backward steps, and the last hidden layer's tail pass. Each checks
 * its operands, allocates its outputs and calls a kernel of kernels.cpp; registered with torch's
 * dispatcher for the CPU when the library is loaded (TORCH_LIBRARY_IMPL below). */
#include <ATen/ops/full_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>

#include "common.h"

namespace cfbnn {
namespace ops {
namespace {

void check_kl(const char* op, const Tensor& loc, const Tensor& log_scale, double prior_variance) {
  check_operands(op, loc, {&log_scale});
  TORCH_CHECK_VALUE(prior_variance > 0, "cfbnn::", op, ": `prior_variance` must be > 0; got ", prior_variance);
}

/* KL(N(loc, diag Var) || N(0, s^2 I)) from (sum Var, sum loc^2, sum log_scale): paper eq. (4)'s KL term. */
double kl_from_sums(const double* sums, double count, double prior_variance) {
  return 0.5 * ((sums[0] + sums[1]) / prior_variance - count + count * std::log(prior_variance)) - sums[2];
}

/* The three sums of the KL, with exp(2 log_scale) written into `variance` where it is defined. */
void kl_sums(const Tensor& loc, const Tensor& log_scale, double* sums, Tensor* variance) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_sums(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), sums,
                             variance != nullptr ? variance->data_ptr<T>() : nullptr, threads());
    return 0;
  });
}

Tensor diagonal_kl(const Tensor& loc_in, const Tensor& log_scale_in, double prior_variance) {
  check_kl("diagonal_kl", loc_in, log_scale_in, prior_variance);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  double sums[3];
  kl_sums(loc, log_scale, sums, nullptr);
  return at::scalar_tensor(kl_from_sums(sums, static_cast<double>(loc.numel()), prior_variance), loc.options());
}

std::tuple<Tensor, Tensor> diagonal_kl_backward(const Tensor& loc_in, const Tensor& log_scale_in, const Tensor& grad,
                                                double prior_variance) {
  check_kl("diagonal_kl_backward", loc_in, log_scale_in, prior_variance);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  const double value = grad.item<double>();
  Tensor grad_loc = at::empty_like(loc), grad_log_scale = at::empty_like(log_scale);
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_backward(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), value / prior_variance,
                                 value, grad_loc.data_ptr<T>(), grad_log_scale.data_ptr<T>(), threads());
    return 0;
  });
  return {grad_loc, grad_log_scale};
}

// ------------------------------------------------------------------------- forward steps

/* [x, 1] and [x^2, 1] (x and x^2 without bias) of an (N, D) input, for `op`. */
std::tuple<Tensor, Tensor> augmented(const char* op, const Tensor& x_in, bool bias) {
  check_floats(op, x_in, {});
  TORCH_CHECK_VALUE(x_in.dim() == 2, "cfbnn::", op, ": `x` must be (N, D); got shape ", x_in.sizes());
  const Tensor x = x_in.contiguous();
  if (!bias) return {x.clone(), at::mul(x, x)};
  const int64_t rows = x.size(0), columns = x.size(1);
  Tensor inputs = at::empty({rows, columns + 1}, x.options()), squares = at::empty_like(inputs);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::augment_pair(rows, columns, x.data_ptr<T>(), inputs.data_ptr<T>(), squares.data_ptr<T>(),
                             threads());
    return 0;
  });
  return {inputs, squares};
}

std::tuple<Tensor, Tensor> augment_pair(const Tensor& x_in, bool bias) { return augmented("augment_pair", x_in, bias); }

const int64_t KL_BLOCK = 1024;  // a KL sums table's block (elbo_reference.KL_BLOCK)

int64_t kl_blocks(const Tensor& loc) { return (loc.numel() + KL_BLOCK - 1) / KL_BLOCK; }

/* A layer's rows of a KL sums table, from row `first` of `table`: exp(2 log_scale) into `variance`,
   loc^2 into `loc_square` where given. */
void kl_table(const Tensor& loc, const Tensor& log_scale, Tensor& table, int64_t first, Tensor& variance,
              Tensor* loc_square) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_table(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), KL_BLOCK,
                              table.data_ptr<double>() + 3 * first, variance.data_ptr<T>(),
                              loc_square != nullptr ? loc_square->data_ptr<T>() : nullptr, threads());
    return 0;
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> outer_layers_pass(const Tensor& x_in, const Tensor& loc_in,
                                                                             const Tensor& log_scale_in,
                                                                             const Tensor& output_loc_in,
                                                                             const Tensor& output_log_scale_in,
                                                                             bool bias) {
  const char* op = "outer_layers_pass";
  check_floats(op, x_in, {&loc_in, &log_scale_in, &output_loc_in, &output_log_scale_in});
  check_numel(op, "log_scale", log_scale_in, loc_in.numel());
  check_numel(op, "output_log_scale", output_log_scale_in, output_loc_in.numel());
  auto [inputs, squares] = augmented(op, x_in, bias);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  const Tensor output_loc = output_loc_in.contiguous(), output_log_scale = output_log_scale_in.contiguous();
  const int64_t blocks = kl_blocks(loc);
  Tensor table = at::empty({blocks + kl_blocks(output_loc), 3}, loc.options().dtype(at::kDouble));
  Tensor variance = at::empty_like(log_scale), output_variance = at::empty_like(output_log_scale);
  Tensor output_loc_square = at::empty_like(output_loc);
  kl_table(loc, log_scale, table, 0, variance, nullptr);
  kl_table(output_loc, output_log_scale, table, blocks, output_variance, &output_loc_square);
  return {inputs, squares, variance, output_variance, output_loc_square, table};
}

std::tuple<Tensor, Tensor, Tensor> diagonal_kl_pass(const Tensor& loc_in, const Tensor& log_scale_in,
                                                    double prior_variance, bool loc_square) {
  check_floats("diagonal_kl_pass", loc_in, {&log_scale_in});
  check_numel("diagonal_kl_pass", "log_scale", log_scale_in, loc_in.numel());
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  Tensor variance = at::empty_like(log_scale);
  double sums[3];
  kl_sums(loc, log_scale, sums, &variance);
  const double kl = kl_from_sums(sums, static_cast<double>(loc.numel()), prior_variance);
  return {at::scalar_tensor(kl, loc.options()), variance,
          loc_square ? at::mul(loc, loc) : at::empty({0}, loc.options())};
}

/* The rows of both likelihood steps: (residual, squares, ELL, sum ELL). */
std::tuple<Tensor, Tensor, Tensor, double> rows(const char* op, const Tensor& mean_sum, const Tensor& spread_sum,
                                                const Tensor& y, const Tensor& loc, const Tensor& log_scale,
                                                const Tensor& log_precision, bool bias) {
  check_floats(op, mean_sum, {&spread_sum, &y, &loc, &log_scale});
  const int64_t count = mean_sum.numel();
  check_numel(op, "spread_sum", spread_sum, count);
  check_numel(op, "y", y, count);
  check_numel(op, "log_scale", log_scale, loc.numel());
  check_numel(op, "log_precision", log_precision, 1);
  const int64_t width = loc.size(-1) - (bias ? 1 : 0);
  TORCH_CHECK_VALUE(width >= 0 && loc.numel() == loc.size(-1), "cfbnn::", op,
                    ": `loc` must be the one-output layer's (1, H [+ 1]); got shape ", loc.sizes());
  const auto [log_beta, beta] = precision(log_precision);
  double mean_bias = 0.0, spread_bias = 0.0;
  if (bias) {
    mean_bias = loc.reshape({-1})[width].item<double>();
    spread_bias = std::exp(2.0 * log_scale.reshape({-1})[width].item<double>());
  }
  const Tensor mean = mean_sum.contiguous(), spread = spread_sum.contiguous(), target = y.contiguous();
  Tensor residual = at::empty_like(mean), squares = at::empty_like(mean), ell = at::empty_like(mean);
  const double total = by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    return Kernels<T>::normal_rows(count, mean.data_ptr<T>(), spread.data_ptr<T>(), target.data_ptr<T>(), mean_bias,
                                   spread_bias, beta, 0.5 * (log_beta - LOG_2PI), residual.data_ptr<T>(),
                                   squares.data_ptr<T>(), ell.data_ptr<T>());
  });
  return {residual, squares, ell, total};
}

std::tuple<Tensor, Tensor, Tensor> normal_ell_rows(const Tensor& mean_sum, const Tensor& spread_sum, const Tensor& y,
                                                   const Tensor& loc, const Tensor& log_scale,
                                                   const Tensor& log_precision, bool bias) {
  auto [residual, squares, ell, total] =
      rows("normal_ell_rows", mean_sum, spread_sum, y, loc, log_scale, log_precision, bias);
  (void)total;
  return {residual, squares, ell};
}

/* The KL of the layers whose rows make a KL sums table (float64 (parts, 3)), the rows added in order. */
double kl_from_table(const char* op, const Tensor& kl_sums, double prior_variance) {
  TORCH_CHECK_VALUE(kl_sums.scalar_type() == at::kDouble && kl_sums.dim() == 2 && kl_sums.size(1) == 3, "cfbnn::", op,
                    ": `kl_sums` must be float64 (parts, 3); got ", kl_sums.scalar_type(), " ", kl_sums.sizes());
  TORCH_CHECK_VALUE(prior_variance > 0, "cfbnn::", op, ": `prior_variance` must be > 0; got ", prior_variance);
  const Tensor table = kl_sums.contiguous();
  const double* row = table.data_ptr<double>();
  double sums[3] = {0.0, 0.0, 0.0};
  for (int64_t part = 0; part < table.size(0); part++, row += 3) {
    for (int k = 0; k < 3; k++) sums[k] += row[k];
  }
  return 0.5 * (sums[0] / prior_variance - sums[2] + sums[2] * std::log(prior_variance)) - sums[1];
}

std::tuple<Tensor, Tensor, Tensor> normal_elbo_rows(const Tensor& mean_sum, const Tensor& spread_sum,
                                                    const Tensor& y, const Tensor& loc, const Tensor& log_scale,
                                                    const Tensor& log_precision, const Tensor& kl_sums,
                                                    const std::optional<Tensor>& kl, double prior_variance,
                                                    double scale, bool bias) {
  const double total_kl = kl_from_table("normal_elbo_rows", kl_sums, prior_variance) +
                          (kl.has_value() ? kl->item<double>() : 0.0);
  auto [residual, squares, ell, total] =
      rows("normal_elbo_rows", mean_sum, spread_sum, y, loc, log_scale, log_precision, bias);
  (void)ell;
  return {residual, squares, at::scalar_tensor(scale * total - total_kl, mean_sum.options())};
}

// ------------------------------------------------------------------------- backward steps

std::tuple<Tensor, Tensor, Tensor, Tensor> normal_rows_backward(const Tensor& grad, const Tensor& residual_in,
                                                                const Tensor& squares_in,
                                                                const Tensor& log_precision, double scale,
                                                                bool row_grads) {
  check_floats("normal_rows_backward", residual_in, {&squares_in, &grad});
  const int64_t count = residual_in.numel();
  check_numel("normal_rows_backward", "squares", squares_in, count);
  check_numel("normal_rows_backward", "grad", grad, row_grads ? count : 1);
  const Tensor per_row = row_grads ? (scale == 1.0 ? grad.contiguous() : at::mul(grad, scale))
                                   : at::full_like(residual_in, grad.item<double>() * scale);
  const Tensor residual = residual_in.contiguous(), squares = squares_in.contiguous();
  const double beta = precision(log_precision).second;
  Tensor row_u = at::empty_like(residual), row_k = at::empty_like(residual);
  Tensor sums = at::empty({3}, residual.options().dtype(at::kDouble));
  by_dtype(residual, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::normal_row_gradients(count, per_row.data_ptr<T>(), residual.data_ptr<T>(), squares.data_ptr<T>(),
                                     beta, row_u.data_ptr<T>(), row_k.data_ptr<T>(), sums.data_ptr<double>());
    return 0;
  });
  Tensor grad_log_precision = at::scalar_tensor(sums.data_ptr<double>()[2], log_precision.options());
  return {row_u, row_k, sums, grad_log_precision.reshape(log_precision.sizes())};
}

/* grad_loc <- data_scale grad_loc + dL/dKL loc / s^2 and grad_variance <- 2 data_scale Var grad_variance +
   dL/dKL (Var / s^2 - 1). */
void finish(const Tensor& loc, const Tensor& variance, Tensor& grad_loc, Tensor& grad_variance, double data_scale,
            double kl, double prior_variance) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_gradient_finish(loc.numel(), loc.data_ptr<T>(), variance.data_ptr<T>(), data_scale,
                                     2.0 * data_scale,
                                     kl / prior_variance, kl, grad_loc.data_ptr<T>(), grad_variance.data_ptr<T>(),
                                     threads());
    return 0;
  });
}

double kl_gradient(const Tensor& kl_grad, double kl_sign) {
  return kl_sign != 0.0 ? kl_sign * kl_grad.item<double>() : 0.0;  // kl_grad is not read where kl_sign is 0
}

/* The data term's gradients' factor: 1, or the upstream gradient where they were taken at a unit one. */
double scale_of(const std::optional<Tensor>& data_scale) {
  return data_scale.has_value() ? data_scale->item<double>() : 1.0;
}

std::tuple<Tensor, Tensor> output_layer_gradients(const Tensor& columns_in, const Tensor& sums, const Tensor& loc_in,
                                                  const Tensor& log_scale_in, const Tensor& kl_grad, double kl_sign,
                                                  double prior_variance, bool bias,
                                                  const std::optional<Tensor>& data_scale) {
  check_floats("output_layer_gradients", loc_in, {&log_scale_in});
  TORCH_CHECK_VALUE(columns_in.scalar_type() == at::kDouble && columns_in.dim() == 2 && columns_in.size(0) == 3,
                    "cfbnn::output_layer_gradients: `columns` must be float64 (3, H); got ",
                    columns_in.scalar_type(), " ", columns_in.sizes());
  TORCH_CHECK_VALUE(sums.scalar_type() == at::kDouble && sums.numel() == 3,
                    "cfbnn::output_layer_gradients: `sums` must be float64 (3,); got ", sums.scalar_type(), " ",
                    sums.sizes());
  const int64_t width = columns_in.size(1);
  check_numel("output_layer_gradients", "loc", loc_in, width + (bias ? 1 : 0));
  check_numel("output_layer_gradients", "log_scale", log_scale_in, loc_in.numel());
  const Tensor loc = loc_in.contiguous(), columns = columns_in.contiguous();
  Tensor grad_loc = at::empty_like(loc), grad_variance = at::empty_like(loc);
  const Tensor sums_cpu = sums.contiguous();
  const double sum_u = sums_cpu.data_ptr<double>()[0], sum_k = sums_cpu.data_ptr<double>()[1];
  const Tensor variance = log_scale_in.mul(2.0).exp_().contiguous();
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::normal_output_gradients(width, columns.data_ptr<double>(), loc.data_ptr<T>(), bias ? 1 : 0, sum_u,
                                        sum_k, scale_of(data_scale), grad_loc.data_ptr<T>(),
                                        grad_variance.data_ptr<T>());
    return 0;
  });
  finish(loc, variance, grad_loc, grad_variance, 1.0, kl_gradient(kl_grad, kl_sign), prior_variance);
  return {grad_loc, grad_variance};
}

void finish_diagonal_gradients(Tensor grad_loc, Tensor grad_variance, const Tensor& loc_in, const Tensor& variance_in,
                               const Tensor& kl_grad, double kl_sign, double prior_variance,
                               const std::optional<Tensor>& data_scale) {
  check_floats("finish_diagonal_gradients", grad_loc, {&grad_variance, &loc_in, &variance_in});
  TORCH_CHECK_VALUE(grad_loc.is_contiguous() && grad_variance.is_contiguous(),
                    "cfbnn::finish_diagonal_gradients: the gradients it finishes in place must be contiguous");
  const int64_t count = loc_in.numel();
  check_numel("finish_diagonal_gradients", "grad_loc", grad_loc, count);
  check_numel("finish_diagonal_gradients", "grad_variance", grad_variance, count);
  check_numel("finish_diagonal_gradients", "variance", variance_in, count);
  const Tensor loc = loc_in.contiguous(), variance = variance_in.contiguous();
  finish(loc, variance, grad_loc, grad_variance, scale_of(data_scale), kl_gradient(kl_grad, kl_sign),
         prior_variance);
}

// ------------------------------------------------------------------------- the ReLU tail pass

void check_tail(const char* op, const Tensor& mean, const Tensor& variance,
                std::initializer_list<const Tensor*> weights) {
  check_floats(op, mean, {&variance});
  TORCH_CHECK_VALUE(mean.dim() == 2 && variance.sizes() == mean.sizes(), "cfbnn::", op,
                    ": `mean` and `variance` must be (rows, H) of one shape; got ", mean.sizes(), " and ",
                    variance.sizes());
  for (const Tensor* weight : weights) {
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == mean.size(1) &&
                          weight->scalar_type() == mean.scalar_type(),
                      "cfbnn::", op, ": each weight must be (", mean.size(1), ",) of dtype ", mean.scalar_type(),
                      "; got ", weight->sizes(), " ", weight->scalar_type());
  }
}

/* The ReLU family's kind for tail_pass (check_activation; a leaky ReLU's slope as the kernels take
   it, slope_for). */
int64_t tail_kind(const char* op, int64_t activation) {
  check_activation(op, activation);
  return activation;
}

std::tuple<Tensor, Tensor> relu_tail(const Tensor& mean_in, const Tensor& variance_in, const Tensor& weight_phi_in,
                                     const Tensor& weight_variance_in, const Tensor& weight_second_in,
                                     int64_t activation, double negative_slope) {
  check_tail("relu_tail", mean_in, variance_in, {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail", activation));
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  const int64_t rows_count = mean.size(0), width = mean.size(1);
  Tensor mean_sum = at::empty({rows_count}, mean.options()), spread_sum = at::empty({rows_count}, mean.options());
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_FORWARD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(), nullptr,
                          nullptr, nullptr, 0.0, 0.0, 0.0, mean_sum.data_ptr<T>(), spread_sum.data_ptr<T>(), nullptr,
                          nullptr, nullptr, threads());
    return 0;
  });
  return {mean_sum, spread_sum};
}

std::tuple<Tensor, Tensor, Tensor> relu_tail_backward(const Tensor& mean_in, const Tensor& variance_in,
                                                      const Tensor& weight_phi_in, const Tensor& weight_variance_in,
                                                      const Tensor& weight_second_in, const Tensor& grad_mean_in,
                                                      const Tensor& grad_spread_in, int64_t activation,
                                                      double negative_slope) {
  check_tail("relu_tail_backward", mean_in, variance_in, {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail_backward", activation));
  const int64_t rows_count = mean_in.size(0), width = mean_in.size(1);
  for (const Tensor* grad : {&grad_mean_in, &grad_spread_in}) {
    TORCH_CHECK_VALUE(grad->dim() == 1 && grad->size(0) == rows_count && grad->scalar_type() == mean_in.scalar_type(),
                      "cfbnn::relu_tail_backward: the row gradients must be (", rows_count, ",) of dtype ",
                      mean_in.scalar_type(), "; got ", grad->sizes(), " ", grad->scalar_type());
  }
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  const Tensor ru = grad_mean_in.contiguous(), rk = grad_spread_in.contiguous();
  Tensor grad_mean = at::empty_like(mean), grad_variance = at::empty_like(mean);
  Tensor columns = at::empty({3, width}, mean.options().dtype(at::kDouble));
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_BACKWARD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(),
                          ru.data_ptr<T>(), rk.data_ptr<T>(), nullptr, 0.0, 0.0, 0.0, nullptr, nullptr,
                          grad_mean.data_ptr<T>(), grad_variance.data_ptr<T>(), columns.data_ptr<double>(), threads());
    return 0;
  });
  return {grad_mean, grad_variance, columns};
}

/* relu_tail and, from the same moments, relu_tail_backward's results for the Normal likelihood's row
   gradients at dL/d ELBO = 1 (u_r = scale beta residual_r, k_r = -scale beta / 2): the rows'
   residuals as normal_rows takes them. */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> relu_tail_with_gradients(
    const Tensor& mean_in, const Tensor& variance_in, const Tensor& weight_phi_in, const Tensor& weight_variance_in,
    const Tensor& weight_second_in, const Tensor& y_in, const Tensor& loc, const Tensor& log_precision, double scale,
    bool bias, int64_t activation, double negative_slope) {
  check_tail("relu_tail_with_gradients", mean_in, variance_in,
             {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail_with_gradients", activation));
  const int64_t rows_count = mean_in.size(0), width = mean_in.size(1);
  check_floats("relu_tail_with_gradients", mean_in, {&y_in, &loc});
  check_numel("relu_tail_with_gradients", "y", y_in, rows_count);
  check_numel("relu_tail_with_gradients", "loc", loc, width + (bias ? 1 : 0));
  check_numel("relu_tail_with_gradients", "log_precision", log_precision, 1);
  const double beta = precision(log_precision).second;
  const double mean_bias = bias ? loc.reshape({-1})[width].item<double>() : 0.0;
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous(), y = y_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  Tensor mean_sum = at::empty({rows_count}, mean.options()), spread_sum = at::empty({rows_count}, mean.options());
  Tensor grad_mean = at::empty_like(mean), grad_variance = at::empty_like(mean);
  Tensor columns = at::empty({3, width}, mean.options().dtype(at::kDouble));
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_AHEAD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(), nullptr,
                          nullptr, y.data_ptr<T>(), mean_bias, scale * beta, -0.5 * scale * beta,
                          mean_sum.data_ptr<T>(), spread_sum.data_ptr<T>(), grad_mean.data_ptr<T>(),
                          grad_variance.data_ptr<T>(), columns.data_ptr<double>(), threads());
    return 0;
  });
  return {mean_sum, spread_sum, grad_mean, grad_variance, columns};
}

}  // namespace
}  // namespace ops
}  // namespace cfbnn

TORCH_LIBRARY_IMPL(cfbnn, CPU, m) {
  using namespace cfbnn::ops;
  m.impl("diagonal_kl", TORCH_FN(diagonal_kl));
  m.impl("diagonal_kl_backward", TORCH_FN(diagonal_kl_backward));
  m.impl("augment_pair", TORCH_FN(augment_pair));
  m.impl("outer_layers_pass", TORCH_FN(outer_layers_pass));
  m.impl("diagonal_kl_pass", TORCH_FN(diagonal_kl_pass));
  m.impl("normal_ell_rows", TORCH_FN(normal_ell_rows));
  m.impl("normal_elbo_rows", TORCH_FN(normal_elbo_rows));
  m.impl("normal_rows_backward", TORCH_FN(normal_rows_backward));
  m.impl("output_layer_gradients", TORCH_FN(output_layer_gradients));
  m.impl("finish_diagonal_gradients", TORCH_FN(finish_diagonal_gradients));
  m.impl("relu_tail", TORCH_FN(relu_tail));
  m.impl("relu_tail_backward", TORCH_FN(relu_tail_backward));
  m.impl("relu_tail_with_gradients", TORCH_FN(relu_tail_with_gradients));
}
