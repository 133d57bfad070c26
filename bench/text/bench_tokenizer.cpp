// Encode throughput and load time of rf::text's tokenizer.json reader on one thread (bench_tokenizer.py runs it
// beside the `tokenizers` library on the same file and text; BENCHMARKS.md).
//   bench_tokenizer TOKENIZER.json TEXT REPEATS OUT.json
// TEXT is encoded whole, and line by line as a batch of documents; each REPEATS times after one untimed pass (the
// word cache warm, as tokenizers' is after its first call). The ids of both are written for the driver to compare.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "text/tokenizer.h"

namespace {

// CPU seconds of this process: on a machine shared with other jobs the wall clock counts their time too, the CPU
// time only ours (the driver reports both).
struct Timer {
  std::chrono::steady_clock::time_point wall = std::chrono::steady_clock::now();
  std::clock_t cpu = std::clock();
  void add_to(std::vector<double>& walls, std::vector<double>& cpus) const {
    walls.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count());
    cpus.push_back(static_cast<double>(std::clock() - cpu) / CLOCKS_PER_SEC);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: bench_tokenizer TOKENIZER.json TEXT REPEATS OUT.json\n";
    return 2;
  }
  const int repeats = std::stoi(argv[3]);
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<std::string> lines;
  std::istringstream lines_in(text);
  for (std::string line; std::getline(lines_in, line);) lines.push_back(line);

  std::vector<double> load, load_cpu, whole_s, whole_cpu, batch_s, batch_cpu, unused;
  std::unique_ptr<rf::text::Tokenizer> tok;
  for (int r = 0; r < repeats; ++r) {
    tok.reset();
    const Timer t;
    tok = rf::text::load_tokenizer(argv[1]);
    t.add_to(load, load_cpu);
  }
  std::vector<int32_t> whole;
  std::vector<std::vector<int32_t>> batch(lines.size());
  for (int r = 0; r <= repeats; ++r) {
    const Timer t;
    whole = tok->encode(text);
    t.add_to(r > 0 ? whole_s : unused, r > 0 ? whole_cpu : unused);
    const Timer u;
    for (size_t i = 0; i < lines.size(); ++i) batch[i] = tok->encode(lines[i]);
    u.add_to(r > 0 ? batch_s : unused, r > 0 ? batch_cpu : unused);
  }
  nlohmann::json out = {{"load_s", median(load)},
                        {"load_cpu", median(load_cpu)},
                        {"encode_s", median(whole_s)},
                        {"encode_cpu", median(whole_cpu)},
                        {"batch_s", median(batch_s)},
                        {"batch_cpu", median(batch_cpu)},
                        {"bytes", text.size()},
                        {"tokens", whole.size()},
                        {"ids", whole},
                        {"batch_ids", batch},
                        {"lines", lines.size()}};
  std::ofstream(argv[4]) << out.dump();
  return 0;
}
