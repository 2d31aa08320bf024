/* placeholder */
typedef int rpc_placeholder;
