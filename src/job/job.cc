// The training job (weft/job.h): a model family's model trained on a text or
// llm.c token file, e.g. train_gpt's
//
//   train_gpt --model mini --data-path /usr/share/games/fortunes/fortunes
//             --micro-batch-size 16 --train-iters 300 --lr 1e-3
//
// Flags follow Megatron-LM's names. Errors print one line naming the value
// and the rule it broke, and exit with status 1.
#include <weft/job.h>
#include <weft/error.h>
#include <weft/mesh.h>
#include <weft/mpi_communicator.h>

#include "src/job/job_internal.h"

#include <fmt/core.h>

#include <chrono>
#include <cstdint>
#include <exception>

namespace weft {

using job_detail::Args;

int train_main(int argc, char** argv, const Job& job) {
  Args a;
  a.job = &job;
  CLI::App app{job.about, job.program};
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  job_detail::add_flags(app, a, job);
  // The program's own defaults: values of flags left out.
  for (const auto& [flag, value] : job.defaults) {
    CLI::Option* o = app.get_option_no_throw(flag);
    if (o == nullptr) {
      fmt::print(stderr, "{}: error: its default for {} names no flag of the job\n", job.program,
                 flag);
      return 1;
    }
    try {
      o->default_val(value);
    } catch (const CLI::Error& e) {
      fmt::print(stderr, "{}: error: its default {} {}: {}\n", job.program, flag, value, e.what());
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // A list flag given twice: the later list replaces the earlier, as any
  // other flag given twice does.
  for (auto [given, list] : {std::pair{&a.data_path_given, &a.data_path},
                             {&a.train_data_path_given, &a.train_data_path},
                             {&a.valid_data_path_given, &a.valid_data_path}})
    if (!given->empty()) *list = given->back();
  const weft::LaunchInfo launch = weft::detect_launch();
  if (!a.check_links) {
    try {
      adopt_checkpoint_args(a, app);
      settle_sharding(a, app);
      apply_plan(a, app, launch.size);
      if (launch.rank == 0 && !a.plan_note.empty()) fmt::print("{}\n", a.plan_note);
    } catch (const std::exception& e) {
      if (launch.rank == 0) fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
      return 1;
    }
  }
  if (a.check_links) {
    if (a.check_links_mib < 1 || a.check_links_mib > 4096) {
      fmt::print(stderr, "{}: error: --check-links-mib ({}) must be in [1, 4096]\n", job.program,
                 a.check_links_mib);
      return 1;
    }
    if (launch.size == 1) {
      fmt::print("--check-links: one rank, so no link to check (run it under mpiexec or srun)\n");
      return 0;
    }
    weft::CommOptions comm;
    comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.comm_timeout * 1000));
    return weft::mpi_main(
        argc, argv, [&](weft::Communicator& world) { return run_link_check(a, world); },
        comm);
  }
  if (launch.size == 1) {
    try {
      return run(a, app, nullptr);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
      return 1;
    }
  }
  // Several ranks: catch bad flags before any communication, printed once.
  try {
    check_param_servers(a, app, launch.size);
    // A plan the run makes itself is checked once it is made.
    if (!a.plan_pending)
      check_parallel(a, resolve_config(a, app), launch.size - a.ps_ranks,
                     a.global_batch > 0 ? a.global_batch : a.micro_batch);
  } catch (const std::exception& e) {
    if (launch.rank == 0) fmt::print(stderr, "{}: error: {}\n", job.program, e.what());
    return 1;
  }
  weft::CommOptions comm;
  comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.comm_timeout * 1000));
  return weft::mpi_main(argc, argv, [&](weft::Communicator& world) { return run(a, app, &world); },
                        comm);
}

}  // namespace weft

