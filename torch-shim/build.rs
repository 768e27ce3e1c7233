fn main() {
    // A soname lets `dlopen("libmemsaver.so", RTLD_NOLOAD)` find the preloaded copy.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmemsaver.so");
}
