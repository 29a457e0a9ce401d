//! ringlimit
