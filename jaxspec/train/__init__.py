"""Training EAGLE-1/2 and EAGLE-3 draft heads for a frozen target (`jaxspec train-draft`)."""
