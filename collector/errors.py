"""The suite's own exceptions. Library code raises these; only the CLI turns them into exit codes."""


class GpuprofError(Exception):
    """Base class: a problem the user or operator can act on; the message says what and where."""


class ConfigError(GpuprofError):
    """The config file is missing, unreadable, not TOML, or has an unknown key or a wrong type."""


class JobLookupError(GpuprofError):
    """Slurm could not tell us about a job (unknown id, scontrol failed, field missing)."""


class TraceFormatError(GpuprofError):
    """A node or job trace file is not what the schema says; the message names the file and field."""


class CollectorError(GpuprofError):
    """The collector could not start, or its control socket did not answer."""


class MergeError(GpuprofError):
    """The merge could not produce a job file (no node files, unknown job, unwritable output)."""
