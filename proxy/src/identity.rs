//! Who the client is (certificate or TokenReview) and how that goes upstream (steps 2–3).
