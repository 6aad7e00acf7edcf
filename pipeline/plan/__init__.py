"""The plan room: pure functions from a compiled iteration to a scheduled one, and the models they
read (costs, hardware, memory footprints, weight sharing), the simulator and the trace format."""
