//! The client-facing TLS listener: handshake, limits, reload, drain (DESIGN.md steps 1 and 9).
