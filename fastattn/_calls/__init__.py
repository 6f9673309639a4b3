"""Call resolution: the checked path of every public call (arguments, the kernel's
operands, the precision setting) and the backward."""
