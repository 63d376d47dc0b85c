"""The two kinds of failure kvcalib reports, each with its documented exit code."""


class KvcalibError(Exception):
    """A failure with a message meant for the user (no traceback) and an exit code."""

    exit_code = 2


class UsageError(KvcalibError):
    """Bad input or a missing environment: exit code 2."""

    exit_code = 2


class CheckFailed(KvcalibError):
    """Calibration produced unusable scales, or a check found a defect: exit code 1."""

    exit_code = 1
