// llama.cpp's logits of the last token of a prompt, one per line: logits MODEL.gguf ID...
// On the CPU (no layer offloaded), 2 threads; same_model.py builds and runs it.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: logits MODEL.gguf ID...\n"); return 1; }
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    std::vector<llama_token> ids;
    for (int i = 2; i < argc; i++) ids.push_back(atoi(argv[i]));
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), ids.size()))) return 2;
    const float * logits = llama_get_logits_ith(ctx, -1);
    int n = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) printf("%.6f\n", logits[i]);
    return 0;
}
