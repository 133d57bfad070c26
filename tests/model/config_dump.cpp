// Test-only tool behind config_defaults.py: prints what ringflex resolves from a config.json — every field with
// its default applied (Gemma4Config::resolved_json), plus the RoPE inverse frequencies of each layer type as the
// model's RoPE tables hold them, read back as the angle at position 1 (atan2 of the table's sin and cos), so the
// frequencies are checked through the code that applies them rather than recomputed from the parameters; and
// every parameter and buffer the model registers for it, name and shape (registered without memory, so the
// defaults' 262144-token vocabulary costs nothing).
//
//     config_dump CONFIG.json      (prints JSON on stdout; a config error goes to stderr with exit code 1)
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "model/config.h"
#include "model/gemma4.h"
#include "model/ops.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: config_dump CONFIG.json\n");
    return 2;
  }
  std::ifstream in(argv[1]);
  std::ostringstream text;
  text << in.rdbuf();
  try {
    const rf::model::Gemma4Config c = rf::model::Gemma4Config::from_json(text.str(), argv[1]);
    nlohmann::json out = nlohmann::json::parse(c.resolved_json());
    const int32_t position_one = 1;
    for (int i = 0; i < c.num_layers; ++i) {
      const rf::model::LayerSpec s = c.layer(i);
      const char* type = s.sliding ? "sliding_attention" : "full_attention";
      if (out["inv_freq"].contains(type)) continue;
      const rf::model::RopeTable t =
          rf::model::make_rope_table(&position_one, 1, s.head_dim, s.rope->proportional, s.rope->theta,
                                     s.rope->partial_rotary_factor, s.rope->factor);
      std::vector<double> inv_freq;
      for (size_t k = 0; k < t.cos.size(); ++k) inv_freq.push_back(std::atan2(t.sin[k], t.cos[k]));
      out["inv_freq"][type] = inv_freq;
    }
    const rf::model::Gemma4Model shapes(c, rf::model::TensorSet::Storage::Deferred);
    for (const rf::model::ParamInfo& t : shapes.params().infos()) out["parameters"][t.name] = t.shape;
    for (const rf::model::Tensor& t : shapes.buffers()) out["buffers"][t.name] = t.shape;
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
