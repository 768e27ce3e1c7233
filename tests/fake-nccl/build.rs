fn main() {
    // Like the real library, so `dlopen("libnccl.so.2", RTLD_NOLOAD)` finds it.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
