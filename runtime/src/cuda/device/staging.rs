//! Pinned host staging for input uploads (see `Loaded::write_input`).
