//! Gives the library the soname of the driver it stands in for, so that programs linked
//! against it (`-lcuda`) ask the loader for `libcuda.so.1`, as with the real one.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
