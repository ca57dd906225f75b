/* The one BPF object of the collector: BCC compiles this file once per collector with the
 * GP_WITH_* switches of the job's modes, because each compile costs about 0.9 s of CPU and raises
 * the collector's peak RSS by about 170 MB (docs/probes.md). */
#define GP_BPF 1
#include "common.h"

#ifdef GP_WITH_COLLECTIVES
#include "collectives.c"
#endif

#ifdef GP_WITH_STACKS
#include "stacks.c"
#endif
#ifdef GP_WITH_OFFCPU
#include "offcpu.c"
#endif
#ifdef GP_WITH_KERNELS
#include "kernels.c"
#endif
