// Placeholder registration so the executable links while `ringflex forward` is written; replaced by the real command.
#include "cli/command.h"
#include "core/error.h"

namespace rf::cli {

void add_forward_command(CLI::App& app, Runner& run) {
  app.add_subcommand("forward", "(not built yet)")->callback([&run] { run = [] { return rf::fail("ringflex forward is not built yet"), 1; }; });
}

}  // namespace rf::cli
