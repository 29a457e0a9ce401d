//! Past this machine: a 50-node cluster in the simulator (filled in below).
