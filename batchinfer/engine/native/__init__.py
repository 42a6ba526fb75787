"""Native code: CPU feature detection, the thread governor, and the build of the C++ sources in csrc/."""
