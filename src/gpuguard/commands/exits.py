"""Exit statuses the commands share (sysexits.h)."""

EX_USAGE = 64
EX_NOPERM = 77  # the command needs a permission this user lacks (root)
