"""A fresh process's own peak RSS around one operation, for the bounded-memory tests.

`PRELUDE` is Python source that defines `status(key)` (a /proc/self/status field, in bytes) and
`reset_peak()` (the kernel's peak-RSS mark set back to the current RSS where /proc/self/clear_refs allows;
it returns the RSS the peak is then measured from). A test script starts with it, imports what it needs,
calls `before = reset_peak()`, runs the operation and reports `status("VmHWM") - before`.
"""

PRELUDE = r"""
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        return status("VmRSS")
    except OSError:
        return status("VmHWM")
"""
