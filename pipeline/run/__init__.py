"""The run room: a run on the driver (session, training loop, run directory, recovery) and the Dask
runtime that executes scheduled iterations on workers' engines."""
