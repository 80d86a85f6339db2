//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/debug/*` (DESIGN.md step 10).
