/* The build's check of the kernels (setup.py links it with kernels.cpp and runs it once per flag
 * set): a wrong build (a broken vector math library, say) must not be installed. ReLU's moments at
 * known points (more than one block of them, so the padded path too) against the closed forms of
 * paper eq. (20) computed here with std::erfc. Exit status 0 when the largest relative error of Phi
 * and Upsilon is at most 1e-12; it prints that error. */
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels.h"

int main() {
  const double cases[3][2] = {{-3.0, 1.0}, {0.0, 0.5}, {1.5, 2.0}};
  const int repeats = 40;
  const int64_t n = 3 * repeats;
  std::vector<double> mean(n), spread(n), phi(n), ups(n), var(n);
  for (int64_t i = 0; i < n; i++) {
    mean[i] = cases[i % 3][0];
    spread[i] = cases[i % 3][1];
  }
  cfbnn::kernels::family_forward_f64(0, n, mean.data(), spread.data(), 0.0, phi.data(), ups.data(), var.data(), 1);
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double m = mean[i], s = spread[i], t = m / s;
    const double cdf = 0.5 * std::erfc(-t / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * t * t) / std::sqrt(2.0 * M_PI);
    const double want_phi = m * cdf + s * pdf, want_ups = (m * m + s * s) * cdf + m * s * pdf;
    const double error = std::max(std::abs(phi[i] - want_phi) / std::abs(want_phi),
                                  std::abs(ups[i] - want_ups) / std::abs(want_ups));
    worst = std::isnan(error) ? INFINITY : std::max(worst, error);
  }
  std::printf("%.3e\n", worst);
  return worst <= 1e-12 ? 0 : 1;
}
