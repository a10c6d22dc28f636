//! castor's compiler passes: classification, autocast, casts, autodiff, loss scaling, the
//! optimizer, fusion, rematerialization, scheduling and memory planning.
//!
//! Passes transform [`castor_ir::Graph`]s and never touch a device.
