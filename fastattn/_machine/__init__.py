"""The machine: the kernel variant for this CPU, threads, the configuration report and
the version."""
