// Placeholder registration so the executable links while `ringflex attn` is written; replaced by the real command.
#include "cli/command.h"
#include "core/error.h"

namespace rf::cli {

void add_attn_command(CLI::App& app, Runner& run) {
  app.add_subcommand("attn", "(not built yet)")->callback([&run] { run = [] { return rf::fail("ringflex attn is not built yet"), 1; }; });
}

}  // namespace rf::cli
