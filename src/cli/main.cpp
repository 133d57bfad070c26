// ringflex: the command-line entry point. Parses the subcommand, starts MPI (a plain run is a singleton
// world of P = 1), runs the subcommand, and maps failures to exit codes.
#include <mpi.h>

#include <cstdio>

#include "cli/command.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"ringflex: context-parallel masked attention and Gemma 4 fine-tuning"};
  app.require_subcommand(1);
  rf::cli::Runner run;
  rf::cli::add_attn_command(app, run);
  rf::cli::add_demo_command(app, run);
  rf::cli::add_plan_command(app, run);
  rf::cli::add_forward_command(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  MPI_Init(&argc, &argv);
  int code = 1;
  try {
    code = run();
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "ringflex: error: %s\n", e.what());
  }
  MPI_Finalize();
  return code;
}
