// ringflex core: what a job may allocate, checked before it allocates.
//
// Sizes come from what inputs claim (a config's vocabulary, a tensor's shape, a rank count); a claim the machine
// cannot hold must end the job with a message saying how much it needs, not with std::bad_alloc or the kernel's
// OOM killer half-way through. The figure compared against is Linux's MemAvailable (what can be allocated without
// swapping), or less where a cgroup limit leaves less (a container, a batch scheduler's job: MemAvailable is the
// host's figure there, and going past the cgroup's limit brings its OOM killer), shared evenly between the ranks
// mpirun placed on this machine, since they all allocate at once.
// RINGFLEX_MEMORY_LIMIT=BYTES (a plain count, or with a K, M or G suffix for KiB, MiB, GiB) caps that figure per
// rank: a job sharing a node with others can keep to its part, and the tests fake a small machine with it.
//
// A job's need is a MemoryBreakdown: named terms, each a lower bound of what the job surely allocates, derived
// beside the code that knows the sizes (model::run_memory_at_least, trainer::train_memory_at_least,
// cp::rows_memory_at_least). A lower bound never stops a job that would fit; the message names the biggest terms.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace rf {

// Bytes this process may allocate: MemAvailable from /proc/meminfo (or the free physical pages where it is
// missing), at most the headroom of this process's cgroups (cgroup_memory_headroom), divided by the number of
// ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE, 1 without mpirun), at most RINGFLEX_MEMORY_LIMIT. Throws
// rf::Error when RINGFLEX_MEMORY_LIMIT is not a byte count.
int64_t available_memory_bytes();
// The parts of it: the machine's figure (MemAvailable at most the cgroups' headroom, for all its ranks together),
// and one rank's share of `node_bytes` among `ranks_on_node` ranks, at most RINGFLEX_MEMORY_LIMIT (`ringflex train
// --plan` asks the second for another machine's figure).
int64_t node_available_bytes();
int64_t rank_share_bytes(int64_t node_bytes, int ranks_on_node);

// What the memory cgroups of this process still let it allocate, or -1 when none sets a limit (or none can be
// read). `proc_cgroup` is the process's cgroup list (/proc/self/cgroup), `cgroup_mount` where the hierarchies are
// mounted (/sys/fs/cgroup); both are parameters so the tests can lay out a fake tree. Headroom = limit - (usage -
// inactive file pages): the kernel reclaims inactive page cache before it OOM-kills, as `docker stats` counts it.
// cgroup v2: memory.max of the process's group and of every ancestor (each limits the subtree), the least
// headroom wins. cgroup v1: the memory controller's group, memory.limit_in_bytes and the hierarchical limit from
// memory.stat; a group path that is not under the mount (a container that sees its own group as the root) is
// read at the mount itself.
int64_t cgroup_memory_headroom(const std::string& proc_cgroup, const std::string& cgroup_mount);

// Named byte counts that add up to what a job needs per rank, in the order they are shown.
class MemoryBreakdown {
 public:
  // `bytes` < 0 marks a term whose size overflowed int64 (the total is then an overflow too).
  void add(std::string name, int64_t bytes);
  void add(const MemoryBreakdown& other);  // every term of `other`, after these
  // The sum; -1 when a term or the sum overflows.
  int64_t total() const;
  // The bytes of the term `name` (0 when there is none).
  int64_t of(const std::string& name) const;
  // "weights 1.0 GiB, activations 12.0 MiB, ...": the non-zero terms, largest first, at most `terms` of them.
  std::string describe(size_t terms = kShownTerms) const;

  static constexpr size_t kShownTerms = 5;  // enough for a job's big parts, short enough for one line

  struct Term {
    std::string name;
    int64_t bytes = 0;
  };
  const std::vector<Term>& terms() const { return terms_; }

 private:
  std::vector<Term> terms_;
};

// The ranks of this job on this machine (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE; 1 under other launchers):
// available_memory_bytes() is the machine's share of one of them.
int local_ranks();

// a * b * c ... as bytes, or -1 when the product overflows int64 (what MemoryBreakdown::add takes as overflow).
int64_t checked_bytes(std::initializer_list<int64_t> factors);
// a + b + c ... of byte counts, or -1 when one of them is -1 or the sum overflows int64.
int64_t checked_sum(std::initializer_list<int64_t> parts);

// Throws rf::Error "<what> needs X GiB of memory, but only Y GiB is available to this rank" when `bytes` exceeds
// available_memory_bytes(). Negative `bytes` (an overflowed size) is an error too.
void check_memory(int64_t bytes, const std::string& what);

// Throws rf::Error "<what> needs at least X of memory per rank (<need.describe()><context>), but only Y is
// available to this rank" when need.total() exceeds available_memory_bytes() (or overflows). `context` adds the
// sizes the figure depends on, e.g. " at seq_len 8192 over cp 2".
void check_memory(const MemoryBreakdown& need, const std::string& what, const std::string& context = "");

// Bytes free to this user on the filesystem holding `dir` (statvfs's f_bavail), shared evenly by the ranks on this
// node as available_memory_bytes() is, at most RINGFLEX_DISK_LIMIT (a byte count as RINGFLEX_MEMORY_LIMIT; the
// tests fake a small disk with it). Throws rf::Error naming `dir` when it cannot be read.
int64_t available_disk_bytes(const std::string& dir);

// Throws rf::Error "<what> needs X of disk per rank in <dir>, but only Y is free to this rank" when `bytes` exceeds
// available_disk_bytes(dir) (a run's spill file, io/spill_file.h, before it is created).
void check_disk(int64_t bytes, const std::string& dir, const std::string& what);

// "1.5 GiB", "12.0 MiB", "812 B": a byte count for messages.
std::string format_bytes(int64_t bytes);

}  // namespace rf
