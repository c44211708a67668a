//! `approvald doctor`: checks a configuration end to end.
