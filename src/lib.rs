pub use castor_ir as ir;
