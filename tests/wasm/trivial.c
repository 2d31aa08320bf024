/* trivial.c — fixture: the smallest inferlet (warm instantiate + run benchmark). */
int main(void) { return 0; }
