"""L0: helpers every layer may use (logging, sizes, flat buffers, timers, device). Imports only torch."""
