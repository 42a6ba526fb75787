"""One rank's model runner: the runner protocol the engine calls, its implementation, CUDA graphs."""
