//! bulwark-sim: a simulated kube-apiserver fleet.
