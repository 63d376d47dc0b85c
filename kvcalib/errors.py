"""The kinds of failure kvcalib reports, each with its documented exit code.

| exit code | meaning                                                   | raised as     |
|-----------|-----------------------------------------------------------|---------------|
| 0         | done; every check passed                                  |               |
| 1         | a check failed, or calibration produced unusable scales   | CheckFailed   |
| 2         | bad input, a missing environment, or a check that could not run | UsageError |
| 130       | interrupted; nothing was written                          |               |
"""


class KvcalibError(Exception):
    """A failure with a message meant for the user (no traceback) and an exit code."""

    exit_code = 2


class UsageError(KvcalibError):
    """Bad input or a missing environment: exit code 2."""

    exit_code = 2


class CheckpointError(UsageError):
    """A file of a checkpoint is malformed, missing or not where it may be (exit 2; verify
    reports it as a failed check instead)."""


class CheckFailed(KvcalibError):
    """Calibration produced unusable scales, or a check found a defect: exit code 1."""

    exit_code = 1


INTERRUPTED = 130
