/*
 * gpuprof_spank.c - SPANK plugin of slurm-gpuprof.
 *
 * Registers `--profile-gpu[=MODES]` in sbatch, salloc and srun (and in
 * slurmstepd, so that the option is forwarded to the job), validates MODES
 * before anything is queued and hands a canonical mode string to the hooks.
 *
 * MODES is a comma-separated list of: metrics, stacks, collectives, kernels.
 * No value means the default set "metrics,stacks,collectives"; so do an empty
 * value and the string "(null)" (how Slurm forwards "no value" to the job,
 * where an srun reads it back).
 *
 * What the hooks see (verified on Slurm 22.05, Debian 12; see docs/slurm.md):
 *
 *   Prolog / Epilog / EpilogSlurmctld environment:
 *     SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu  the value exactly as given
 *         by the user after validation (Slurm forwards the raw argument, so
 *         it is not canonicalised). Given without a value, Slurm 22.05 sets
 *         it to the literal string "(null)"; treat "(null)" and "" as the
 *         default set.
 *     SPANK_GPUPROF_MODES  the canonical value (deduplicated, canonical order,
 *         default set filled in), set through spank_job_control_setenv() by
 *         sbatch/salloc/srun. Present only when the option was given.
 *   Job tasks and TaskProlog:
 *     SLURM_SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu  raw value, as above.
 *     GPUPROF_MODES  canonical value, set with spank_setenv() in slurmstepd.
 *
 * Plugin arguments in plugstack.conf: none are accepted; any argument makes
 * slurm_spank_init() fail with an error naming it, so a typo cannot go
 * unnoticed.
 *
 * Only the symbols Slurm looks up are exported (-fvisibility=hidden plus the
 * linker version script gpuprof_spank.map).
 */

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <slurm/spank.h>

#define GPUPROF_EXPORT __attribute__((visibility("default")))

#pragma GCC visibility push(default)
SPANK_PLUGIN(gpuprof, 1)
#pragma GCC visibility pop

#define OPT_NAME "profile-gpu"
#define MAX_VALUE_LEN 128
#define VALID_MODES "metrics, stacks, collectives, kernels"
#define DEFAULT_HINT "no value means metrics,stacks,collectives"

/* Canonical order of the modes; the bit of mode i is (1u << i). */
static const char *const mode_names[] = {"metrics", "stacks", "collectives", "kernels"};
#define N_MODES (sizeof(mode_names) / sizeof(mode_names[0]))
#define DEFAULT_MASK 0x7u /* metrics | stacks | collectives */

/* Set by the option callback (same process), read by the later hooks. */
static unsigned int selected_mask;
static int option_seen;

static void usage_error(const char *what)
{
	slurm_error("gpuprof: invalid --" OPT_NAME " value: %s; valid modes: " VALID_MODES
		    " (comma-separated, " DEFAULT_HINT ")", what);
}

/*
 * Parse MODES into a bit mask. Returns 0 and sets *mask on success, -1 after
 * reporting the problem. Never echoes characters outside [a-z,].
 */
static int parse_modes(const char *arg, unsigned int *mask)
{
	size_t len, i, start;
	unsigned int m = 0;
	char msg[MAX_VALUE_LEN + 64];

	/*
	 * No value: the callback gets NULL. Slurm 22.05 forwards that to the job
	 * environment (and to the Prolog/Epilog) as the literal string "(null)",
	 * and an srun inside the job reads the option back from that variable
	 * (SLURM_SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu) with remote == 0.
	 * So NULL, "(null)" and "" all mean the default set, in every context;
	 * refusing them would make every srun inside a profiled job fail.
	 */
	if (arg == NULL || arg[0] == '\0' || strcmp(arg, "(null)") == 0) {
		*mask = DEFAULT_MASK;
		return 0;
	}
	len = strnlen(arg, MAX_VALUE_LEN + 1);
	if (len > MAX_VALUE_LEN) {
		snprintf(msg, sizeof(msg), "longer than %d characters", MAX_VALUE_LEN);
		usage_error(msg);
		return -1;
	}
	for (i = 0; i < len; i++) {
		char c = arg[i];
		if (!((c >= 'a' && c <= 'z') || c == ',')) {
			snprintf(msg, sizeof(msg),
				 "character %zu is not a lower-case letter or a comma", i + 1);
			usage_error(msg);
			return -1;
		}
	}
	start = 0;
	for (i = 0; i <= len; i++) {
		if (i < len && arg[i] != ',')
			continue;
		size_t n = i - start;
		size_t k;
		if (n == 0) {
			usage_error("empty item in the list");
			return -1;
		}
		for (k = 0; k < N_MODES; k++) {
			if (strlen(mode_names[k]) == n && strncmp(arg + start, mode_names[k], n) == 0)
				break;
		}
		if (k == N_MODES) {
			snprintf(msg, sizeof(msg), "unknown mode \"%.*s\"", (int)n, arg + start);
			usage_error(msg);
			return -1;
		}
		m |= 1u << k;
		start = i + 1;
	}
	*mask = m;
	return 0;
}

static void canonical(unsigned int mask, char *buf, size_t size)
{
	size_t k;
	buf[0] = '\0';
	for (k = 0; k < N_MODES; k++) {
		if (!(mask & (1u << k)))
			continue;
		if (buf[0] != '\0')
			strncat(buf, ",", size - strlen(buf) - 1);
		strncat(buf, mode_names[k], size - strlen(buf) - 1);
	}
}

static int profile_gpu_cb(int val, const char *optarg, int remote)
{
	unsigned int mask;

	(void)val;
	(void)remote;
	if (parse_modes(optarg, &mask) < 0)
		return -1;
	selected_mask = mask;
	option_seen = 1;
	return 0;
}

static struct spank_option profile_gpu_option = {
	OPT_NAME,
	"MODES",
	"Profile the job's GPUs, CPUs and collectives with slurm-gpuprof. MODES is a "
	"comma-separated list of metrics, stacks, collectives, kernels "
	"(no value: metrics,stacks,collectives).",
	2, /* optional argument: --profile-gpu or --profile-gpu=MODES */
	0,
	profile_gpu_cb,
};

GPUPROF_EXPORT int slurm_spank_init(spank_t sp, int ac, char *av[])
{
	spank_context_t ctx = spank_context();
	int i;

	if (ac > 0) {
		for (i = 0; i < ac; i++)
			slurm_error("gpuprof: unknown plugstack.conf argument \"%s\" "
				    "(gpuprof_spank.so takes no arguments)", av[i]);
		return -1;
	}
	if (ctx == S_CTX_LOCAL || ctx == S_CTX_ALLOCATOR || ctx == S_CTX_REMOTE) {
		if (spank_option_register(sp, &profile_gpu_option) != ESPANK_SUCCESS) {
			slurm_error("gpuprof: cannot register --" OPT_NAME);
			return -1;
		}
	}
	return 0;
}

/*
 * sbatch/salloc/srun: after all options are parsed, put the canonical value
 * into the job control environment (Prolog/Epilog see it as SPANK_GPUPROF_MODES).
 * Failing here only loses the convenience variable, never the job.
 */
GPUPROF_EXPORT int slurm_spank_init_post_opt(spank_t sp, int ac, char *av[])
{
	spank_context_t ctx = spank_context();
	char buf[64];

	(void)ac;
	(void)av;
	if (!option_seen)
		return 0;
	canonical(selected_mask, buf, sizeof(buf));
	if (ctx == S_CTX_LOCAL || ctx == S_CTX_ALLOCATOR) {
		if (spank_job_control_setenv(sp, "GPUPROF_MODES", buf, 1) != ESPANK_SUCCESS)
			slurm_verbose("gpuprof: could not set SPANK_GPUPROF_MODES");
	}
	return 0;
}

/* slurmstepd: give the job's tasks (and the TaskProlog) GPUPROF_MODES. */
GPUPROF_EXPORT int slurm_spank_user_init(spank_t sp, int ac, char *av[])
{
	char buf[64];

	(void)ac;
	(void)av;
	if (!option_seen || spank_remote(sp) != 1)
		return 0;
	canonical(selected_mask, buf, sizeof(buf));
	if (spank_setenv(sp, "GPUPROF_MODES", buf, 1) != ESPANK_SUCCESS)
		slurm_verbose("gpuprof: could not set GPUPROF_MODES");
	return 0;
}
