// Placeholder registration so the executable links while `ringflex demo` is written; replaced by the real command.
#include "cli/command.h"
#include "core/error.h"

namespace rf::cli {

void add_demo_command(CLI::App& app, Runner& run) {
  app.add_subcommand("demo", "(not built yet)")->callback([&run] { run = [] { return rf::fail("ringflex demo is not built yet"), 1; }; });
}

}  // namespace rf::cli
