// ringflex trainer: progress, metrics and the loss picture (see metrics.h).
#include "trainer/metrics.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "io/atomic_file.h"

namespace rf::trainer {

std::string metrics_json_line(const StepMetrics& m) {
  nlohmann::ordered_json j = {{"step", m.step},
                              {"loss", m.loss},
                              {"lr", m.lr},
                              {"grad_norm", m.grad_norm},
                              {"tokens", m.tokens},
                              {"tokens_per_s", m.tokens_per_s},
                              {"peak_rss_bytes", m.peak_rss_bytes}};
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (m.comm_wait_s) j["comm_wait_s"] = *m.comm_wait_s;
  if (m.ep_rows_sent) j["ep_rows_sent"] = *m.ep_rows_sent;
  if (m.ep_rows_received) j["ep_rows_received"] = *m.ep_rows_received;
  if (m.tower_share) j["tower_share"] = *m.tower_share;
  j["data_share"] = m.data_share;
  if (m.shard_comm_wait_s) j["shard_comm_wait_s"] = *m.shard_comm_wait_s;
  if (m.ep_experts_held) j["ep_experts_held"] = *m.ep_experts_held;
  if (m.ep_bytes_per_layer) j["ep_bytes_per_layer"] = *m.ep_bytes_per_layer;
  if (m.ep_exposed_s) j["ep_exposed_s"] = *m.ep_exposed_s;
  return j.dump() + "\n";
}

namespace {

// The length of `text`'s leading whole lines whose step (each line starts `{"step":N,`, metrics_json_line) is at
// most `step`: where a resumed run's file continues.
int64_t kept_length(const std::string& text, int64_t step) {
  constexpr std::string_view kStart = "{\"step\":";
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    if (end == std::string::npos || text.compare(at, kStart.size(), kStart) != 0) break;
    if (std::strtoll(text.c_str() + at + kStart.size(), nullptr, 10) > step) break;
    at = end + 1;
  }
  return static_cast<int64_t>(at);
}

}  // namespace

MetricsFile::MetricsFile(const std::string& path, int64_t keep_through_step) : path_(path) {
  constexpr mode_t kNewFileMode = 0666;  // before the umask, as fopen creates files
  constexpr size_t kReadChunk = size_t{1} << 16;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, kNewFileMode);
  RF_CHECK(fd_ >= 0, path, ": cannot open for writing: ", std::strerror(errno));
  // A failure past the open closes the file itself: the destructor of an object whose constructor threw never runs.
  const auto check = [&](bool ok, const std::string& what) {
    if (ok) return;
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    rf::fail(path, ": ", what, ": ", std::strerror(err));
  };
  std::string text;
  if (keep_through_step > 0) {
    std::vector<char> buf(kReadChunk);
    for (ssize_t n; (n = ::read(fd_, buf.data(), buf.size())) != 0;) {
      check(n > 0 || errno == EINTR, "cannot read");
      if (n > 0) text.append(buf.data(), static_cast<size_t>(n));
    }
  }
  size_ = kept_length(text, keep_through_step);
  check(::ftruncate(fd_, size_) == 0 && ::lseek(fd_, size_, SEEK_SET) == size_,
        rf::concat("cannot cut the file back to its lines of steps 1 to ", keep_through_step));
}

MetricsFile::~MetricsFile() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsFile::append(const std::string& line) {
  RF_CHECK(fd_ >= 0, path_, ": write after the file was closed");
  const int err = io::write_all(fd_, path_, std::as_bytes(std::span<const char>(line.data(), line.size())));
  if (err != 0) {
    // Whatever part of the line reached the file is cut off again.
    const bool cut = ::ftruncate(fd_, size_) == 0 && ::lseek(fd_, size_, SEEK_SET) == size_;
    rf::fail(path_, ": write failed: ", std::strerror(err), cut ? "" : " (and the partial line could not be removed)");
  }
  size_ += static_cast<int64_t>(line.size());
}

void MetricsFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  RF_CHECK(::close(fd) == 0, path_, ": write failed (close): ", std::strerror(errno));
}

int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  constexpr int64_t kBytesPerKiB = 1024;  // Linux reports ru_maxrss in KiB
  return static_cast<int64_t>(u.ru_maxrss) * kBytesPerKiB;
}

std::string loss_svg(const LossHistory& h, const std::string& title) {
  constexpr double kWidth = 720, kHeight = 400, kLeft = 60, kRight = 20, kTop = 36, kBottom = 44;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  RF_ASSERT(h.loss.size() == h.steps.size() && h.val_loss.size() == h.val_steps.size());
  double lo = INFINITY, hi = -INFINITY;
  int last_step = 1;
  for (double v : h.loss) lo = std::min(lo, v), hi = std::max(hi, v);
  for (double v : h.val_loss) lo = std::min(lo, v), hi = std::max(hi, v);
  for (int s : h.steps) last_step = std::max(last_step, s);
  if (!(lo <= hi)) lo = 0, hi = 1;
  if (hi - lo < 1e-9) hi = lo + 1;
  const auto x = [&](int64_t step) { return kLeft + plot_w * step / last_step; };
  const auto y = [&](double v) { return kTop + plot_h * (hi - v) / (hi - lo); };
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << kLeft << "\" y=\"20\" font-size=\"14\">" << title << "</text>\n";
  s << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << plot_w << "\" height=\"" << plot_h
    << "\" fill=\"none\" stroke=\"#888\"/>\n";
  constexpr int kTicks = 5;
  for (int i = 0; i <= kTicks; ++i) {
    const double v = lo + (hi - lo) * i / kTicks;
    std::ostringstream label;
    label.precision(3);
    label << v;
    s << "<text x=\"" << kLeft - 6 << "\" y=\"" << y(v) + 4 << "\" text-anchor=\"end\">" << label.str() << "</text>\n";
    const int64_t step = int64_t{last_step} * i / kTicks;  // last_step * kTicks can pass int's range
    s << "<text x=\"" << x(step) << "\" y=\"" << kHeight - kBottom + 16 << "\" text-anchor=\"middle\">" << step
      << "</text>\n";
  }
  s << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << kHeight - 8 << "\" text-anchor=\"middle\">step</text>\n";
  if (!h.steps.empty()) {
    s << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < h.steps.size(); ++i) s << x(h.steps[i]) << "," << y(h.loss[i]) << " ";
    s << "\"/>\n";
  }
  for (size_t i = 0; i < h.val_steps.size(); ++i)
    s << "<circle cx=\"" << x(h.val_steps[i]) << "\" cy=\"" << y(h.val_loss[i]) << "\" r=\"4\" fill=\"#d62728\"/>\n";
  s << "<line x1=\"" << kWidth - 190 << "\" y1=\"20\" x2=\"" << kWidth - 170
    << "\" y2=\"20\" stroke=\"#1f77b4\" stroke-width=\"2\"/><text x=\"" << kWidth - 165 << "\" y=\"24\">train</text>\n";
  s << "<circle cx=\"" << kWidth - 110 << "\" cy=\"20\" r=\"4\" fill=\"#d62728\"/><text x=\"" << kWidth - 100
    << "\" y=\"24\">validation</text>\n</svg>\n";
  return s.str();
}

namespace {
// Under mpirun a rank's stdout is a pseudo-terminal of the launcher (Open MPI's I/O forwarding) whatever mpirun's
// own stdout is, so isatty says nothing there; a launched rank prints whole lines, which read well either way.
bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}
}  // namespace

Progress::Progress(std::FILE* out, int total_steps, int every)
    : out_(out),
      terminal_(out != nullptr && isatty(fileno(out)) && !launched_by_mpirun()),
      total_(total_steps),
      every_(every) {}

namespace {
std::string format_eta(double s) {
  const int t = static_cast<int>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%d:%02d", t / 60, t % 60);
  return buf;
}
}  // namespace

void Progress::step(const StepMetrics& m, double eta_s, bool force_line) {
  if (!out_) return;
  if (!terminal_ && !force_line && m.step % every_ != 0) return;
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  ETA %s",
                static_cast<long long>(m.step), total_, m.loss, m.lr, m.grad_norm, m.tokens_per_s,
                format_eta(eta_s).c_str());
  if (terminal_) {
    std::fprintf(out_, "\r%s\x1b[K", line);  // rewrite in place, clearing what a longer line left
    open_line_ = true;
  } else {
    std::fprintf(out_, "%s\n", line);
  }
  std::fflush(out_);
}

void Progress::note(const std::string& line) {
  if (!out_) return;
  if (open_line_) std::fputc('\n', out_);
  open_line_ = false;
  std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

}  // namespace rf::trainer
