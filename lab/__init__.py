"""The lab: GPU micro-benchmarks, step probes and trace tools used to measure and tune the engine
(`python -m lab.kernels`, `lab/gpu_suite.sh`). Not part of the installed product; the user's load
generator is `bench/` (`serve bench`)."""
