// C++ names with templates (tests/test_symbolize_debuginfo.py): a class template's member, a
// function template, both instantiated and kept out of line.
#include <cstdio>

namespace geo {
template <typename T, int N>
struct Box {
    T v[N];
    __attribute__((noinline)) T sum() const {
        T s = 0;
        for (int i = 0; i < N; i++) s += v[i];
        return s;
    }
};

template <typename F>
__attribute__((noinline)) double apply_twice(F f, double x) {
    return f(f(x));
}
}  // namespace geo

int main() {
    geo::Box<double, 3> b{{1, 2, 3}};
    double r = geo::apply_twice([](double x) { return x * 2; }, b.sum());
    std::printf("%f\n", r);
    return 0;
}
