//! Turns method, path and query into a request info like the apiserver's (DESIGN.md step 4).
