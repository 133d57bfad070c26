// ringflex cli: how a subcommand plugs into the `ringflex` executable.
//
// Each subcommand lives in its own cmd_<name>.cpp and exposes add_<name>_command, which registers a CLI11
// subcommand and a `run` callback. main.cpp owns process-level concerns: MPI start-up and shutdown, and turning
// an rf::Error into one line on stderr and a non-zero exit.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace rf::cli {

// Set by the selected subcommand during parsing; main calls it after MPI is up. Returns the exit code.
using Runner = std::function<int()>;

void add_attn_command(CLI::App& app, Runner& run);
void add_demo_command(CLI::App& app, Runner& run);
void add_plan_command(CLI::App& app, Runner& run);
void add_forward_command(CLI::App& app, Runner& run);
void add_train_command(CLI::App& app, Runner& run);
void add_info_command(CLI::App& app, Runner& run);
void add_export_command(CLI::App& app, Runner& run);
void add_generate_command(CLI::App& app, Runner& run);
void add_data_command(CLI::App& app, Runner& run);

}  // namespace rf::cli
