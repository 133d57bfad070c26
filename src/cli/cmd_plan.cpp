// Placeholder registration so the executable links while `ringflex plan` is written; replaced by the real command.
#include "cli/command.h"
#include "core/error.h"

namespace rf::cli {

void add_plan_command(CLI::App& app, Runner& run) {
  app.add_subcommand("plan", "(not built yet)")->callback([&run] { run = [] { return rf::fail("ringflex plan is not built yet"), 1; }; });
}

}  // namespace rf::cli
