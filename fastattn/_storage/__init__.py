"""Storage kinds: the table the C kernels share, and the quantised formats."""
